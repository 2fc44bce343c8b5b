"""benchmarks/quant_ppl.py end to end on the real SmolLM2 GGUF with the cheap methods and one
short window: the GGUF converts to an HF directory, each format quantizes and is measured, and
the records and table say what was run (the full table is a GPU run)."""

from __future__ import annotations

import pytest
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quant_ppl.py"


def _module():
    spec = importlib.util.spec_from_file_location("quant_ppl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # ~1.5 min; eval ppl --quantization covers the same path
def test_quant_ppl_script_on_smollm2(smollm2_gguf, tmp_path):
    mod = _module()
    out = tmp_path / "out"
    assert mod.main(["--model", str(smollm2_gguf), "--name", "smollm2-135m", "--methods",
                     "bf16,rtn-int8,rtn-int4-g128", "--limit", "1", "--context", "128",
                     "--device", "cpu", "--work", str(tmp_path / "work"), "--out",
                     str(out)]) == 0
    (jsonl,) = out.glob("*-W6-quant-smollm2-135m.jsonl")
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["config"]["quantization"] for r in recs] == ["bf16", "rtn-int8", "rtn-int4-g128"]
    assert all(r["metric"] == "ppl" and r["value"] > 1 and r["workload"] == "W6" for r in recs)
    assert all(r["config"]["context"] == 128 and r["config"]["scored_tokens"] == 127
               for r in recs)
    int4 = recs[2]["config"]
    assert int4["group_size"] == 64 and "does not tile" in int4["note"]  # 576-wide rows
    md = jsonl.with_suffix(".md").read_text()
    assert "| rtn-int4-g128 |" in md and "Partial: the first 1 windows" in md


def test_fitting_group_for_qwen_and_smollm_shapes(tmp_path):
    mod = _module()
    for hidden, inter, heads, want in ((576, 1536, 9, 64), (896, 4864, 14, 128)):
        (tmp_path / "config.json").write_text(json.dumps({
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads}))
        assert mod.fitting_group(tmp_path, 128) == want
    assert mod.fitting_group(tmp_path, None) is None
