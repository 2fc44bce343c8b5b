"""Sliding-window perplexity (llmaccel/eval/perplexity.py, eval/hf_perplexity.py): window
arithmetic by hand, row joining, both backends (our engine; transformers' own loss) on a tiny
model against an independent token-by-token computation with transformers, the exact set of
tokens transformers' shifted loss scores, and the `llmaccel eval ppl` command (tiny models with a
word-level tokenizer; the real SmolLM2 GGUF)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmaccel.errors import LLMAccelError
from llmaccel.eval.hf_perplexity import (hf_labels, hf_perplexity, hf_scored_positions,
                                         hf_window_nll)
from llmaccel.eval.perplexity import PerplexityResult, join_rows, perplexity, window_nll, windows
from llmaccel.models.loader import load_model
from tiny_models import make_tiny_model, save_word_tokenizer, tiny_configs


def test_windows_by_hand():
    # stride == context: each window's first token has no history and is not scored
    assert windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    # stride < context: each token scored once, with at least context - stride of history
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert windows(3, 8, 8) == [(0, 3, 1)]
    assert windows(9, 4, 4) == [(0, 4, 1), (4, 8, 5)]  # a last window of one token scores 0
    scored = sum(e - f for _, e, f in windows(1000, 64, 16))
    assert scored == 999  # every token but the very first, exactly once


@pytest.mark.parametrize("args, match", [((10, 1, 1), "context"), ((10, 4, 5), "stride"),
                                         ((10, 4, 0), "stride"), ((1, 4, 4), "at least 2")])
def test_windows_reject_bad_settings(args, match):
    with pytest.raises(LLMAccelError, match=match):
        windows(*args)


def test_hf_row_joining():
    raw = " = Title = \n \n Para one .\n Para two .\n"
    # rows: " = Title = \n", "", " Para one .\n", " Para two .\n", joined with a blank line
    assert join_rows(raw, "hf") == " = Title = \n\n\n\n\n Para one .\n\n\n Para two .\n"
    assert join_rows(raw, "raw") == raw
    with pytest.raises(LLMAccelError, match="joining"):
        join_rows(raw, "csv")


def _independent_ppl(hf, ids, context, stride):
    """Token by token: for each token t scored by window (b, e, f), its NLL from a separate
    transformers forward over ids[b:t] (the last position's log-softmax)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b, e, f in windows(len(ids), context, stride):
            for t in range(f, e):
                logits = hf(torch.tensor([ids[b:t]])).logits[0, -1].double()
                total -= float(torch.log_softmax(logits, -1)[ids[t]])
                count += 1
    return math.exp(total / count), count


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, our model, directory) of one tiny random Qwen2."""
    d = tmp_path_factory.mktemp("tiny-qwen2")
    hf = make_tiny_model(tiny_configs()["qwen2"], d)
    _, ours = load_model(str(d), dtype="float32", device="cpu")
    return hf, ours, d


@pytest.mark.parametrize("context,stride", [(16, 16), (16, 5)])
def test_perplexity_equals_token_by_token_computation(tiny, context, stride):
    hf, ours, _ = tiny
    ids = torch.randint(0, hf.config.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    want, count = _independent_ppl(hf, ids.tolist(), context, stride)
    res = perplexity(ours, ids, context, stride)
    # stride == context leaves each window's first token unscored (45 - 3); overlap does not
    assert res.scored_tokens == count == (42 if stride == context else 44)
    assert res.ppl == pytest.approx(want, rel=1e-5)
    assert res.backend == "llmaccel"
    limited = perplexity(ours, ids, context, stride, limit=2)
    assert limited.windows == 2 and limited.scored_tokens < count
    # transformers' own loss over the same windows: the same tokens, the same value
    theirs = hf_perplexity(hf, ids, context, stride)
    assert theirs.backend == "hf"
    assert theirs.scored_tokens == count and theirs.windows == res.windows
    assert theirs.ppl == pytest.approx(want, rel=1e-4)
    assert theirs.ppl == pytest.approx(res.ppl, rel=1e-4)
    hf_limited = hf_perplexity(hf, ids, context, stride, limit=2)
    assert hf_limited.scored_tokens == limited.scored_tokens


@pytest.mark.parametrize("n,context,stride", [(45, 16, 16), (45, 16, 5), (40, 12, 1),
                                               (7, 16, 16)])
def test_hf_loss_scores_exactly_our_tokens(tiny, n, context, stride):
    """For every window, the positions transformers' shifted loss scores are the tokens our
    engine scores (first..end), and its loss is their mean NLL from the logits one step
    earlier, which is what our window_nll sums."""
    hf, ours, _ = tiny
    ids = torch.randint(0, hf.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    for begin, end, first in windows(n, context, stride):
        window = ids[begin:end]
        labels = hf_labels(window, first - begin)
        assert [begin + t for t in hf_scored_positions(labels)] == list(range(first, end))
        with torch.no_grad():
            out = hf(input_ids=window[None], labels=labels[None])
            logp = torch.log_softmax(out.logits[0].double(), -1)
        by_hand = -sum(float(logp[t - 1 - begin, ids[t]]) for t in range(first, end))
        assert float(out.loss) * (end - first) == pytest.approx(by_hand, rel=1e-5)
        theirs, count = hf_window_nll(hf, window, first - begin)
        mine, count_ours = window_nll(ours, window, first - begin)
        assert count == count_ours == end - first
        assert theirs == pytest.approx(by_hand, rel=1e-5)
        assert mine == pytest.approx(by_hand, rel=1e-5)


def test_hf_labels_reject_windows_without_scored_tokens():
    with pytest.raises(LLMAccelError, match="first scored index"):
        hf_labels(torch.arange(4), 0)  # position 0 has no logits before it
    with pytest.raises(LLMAccelError, match="first scored index"):
        hf_labels(torch.arange(4), 4)


def test_result_to_dict_states_backend():
    res = PerplexityResult(ppl=2.0, nll=0.69, scored_tokens=3, total_tokens=4, windows=1,
                           context=4, stride=4, data="x", joining="file", seconds=0.1)
    assert res.backend == "llmaccel"  # the old constructor still works
    assert res.to_dict()["backend"] == "llmaccel"


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer, and a text file of its words."""
    d = tmp_path_factory.mktemp("tiny-llama-tok")
    g = torch.Generator().manual_seed(0)
    words = [f"w{i}" for i in range(60)]
    text = " ".join(words[int(i)] for i in torch.randint(0, 60, (300,), generator=g))
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = save_word_tokenizer(sorted(set(text.split())), d)
    make_tiny_model(cfg, d, seed=2)
    (d / "eval.txt").write_text(text)
    return d


def _ppl_json(*args: str) -> dict:
    from typer.testing import CliRunner

    from llmaccel.cli import app

    result = CliRunner().invoke(app, ["eval", "ppl", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.rindex('{"model"'):])


@pytest.mark.parametrize("stride", [None, "24"])
def test_eval_ppl_cli_backends_agree(tiny_with_tokenizer, stride):
    d = tiny_with_tokenizer
    args = [str(d), "--data", str(d / "eval.txt"), "--context", "64", "--device", "cpu",
            "--dtype", "float32", *(["--stride", stride] if stride else [])]
    ours = _ppl_json(*args)
    theirs = _ppl_json(*args, "--backend", "hf")
    assert ours["backend"] == "llmaccel" and theirs["backend"] == "hf"
    # the same tokenizer, hence the same stream and windows
    for key in ("total_tokens", "scored_tokens", "windows", "context", "stride", "joining"):
        assert ours[key] == theirs[key], key
    assert ours["total_tokens"] == 300 and ours["stride"] == int(stride or 64)
    assert theirs["ppl"] == pytest.approx(ours["ppl"], rel=1e-4)


def test_eval_ppl_cli_text_states_backend(tiny_with_tokenizer):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    d = tiny_with_tokenizer
    result = CliRunner().invoke(app, ["eval", "ppl", str(d), "--data", str(d / "eval.txt"),
                                      "--context", "32", "--limit", "1", "--device", "cpu",
                                      "--backend", "hf"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "backend hf" in text and "context 32, stride 32" in text
    assert "rows joined: file" in text


def test_eval_ppl_quantization_measures_the_quantized_checkpoint(tiny_with_tokenizer, tmp_path):
    """--quantization writes the scheme's checkpoint (kept with --quantized-dir) and measures
    it: the same number as measuring that directory itself, and not the plain model's."""
    d = tiny_with_tokenizer
    args = ["--data", str(d / "eval.txt"), "--context", "64", "--device", "cpu",
            "--dtype", "float32"]
    plain = _ppl_json(str(d), *args)
    kept = tmp_path / "int4"
    quant = _ppl_json(str(d), *args, "--quantization", "rtn-int4-g128",
                      "--quantized-dir", str(kept))
    assert quant["quantization"] == "rtn-int4-g128"
    assert quant["quantization_config"]["method"] == "rtn"
    assert quant["quantization_config"]["bits"] == 4
    config = json.loads((kept / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    again = _ppl_json(str(kept), *args)
    assert again["ppl"] == pytest.approx(quant["ppl"], rel=1e-6)
    assert quant["ppl"] != pytest.approx(plain["ppl"], rel=1e-4)  # int4 moved the weights


def test_eval_ppl_rejects_an_unknown_scheme(tiny_with_tokenizer):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    d = tiny_with_tokenizer
    result = CliRunner().invoke(app, ["eval", "ppl", str(d), "--data", str(d / "eval.txt"),
                                      "--quantization", "int3-magic"])
    assert isinstance(result.exception, LLMAccelError)  # main() prints it as one line
    assert "unknown quantization scheme 'int3-magic'" in str(result.exception)


def test_eval_ppl_cli_rejects_unknown_backend(tiny_with_tokenizer):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    d = tiny_with_tokenizer
    result = CliRunner().invoke(app, ["eval", "ppl", str(d), "--data", str(d / "eval.txt"),
                                      "--backend", "vllm"])
    assert isinstance(result.exception, LLMAccelError)
    assert "backend" in str(result.exception)


def test_hf_backend_refuses_a_shape():
    from llmaccel.eval.hf_perplexity import load_hf_causal_lm
    from llmaccel.models.config import make_model_config

    with pytest.raises(LLMAccelError, match="real checkpoint"):
        load_hf_causal_lm(make_model_config("smollm2-135m"), "cpu")


def test_eval_ppl_cli_on_smollm2(smollm2_gguf, tmp_path):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    result = CliRunner().invoke(app, ["eval", "ppl", str(smollm2_gguf), "--data", str(text),
                                      "--context", "64", "--limit", "2", "--json",
                                      "--device", "cpu", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.rindex('{"model"'):])
    assert out["windows"] == 2 and out["context"] == 64 and out["joining"] == "file"
    # a repeated sentence is easy: far below a uniform guess over 49,152 tokens
    assert 1.0 < out["ppl"] < 50


def test_eval_ppl_cli_errors_name_the_problem(tmp_path):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    result = CliRunner().invoke(app, ["eval", "ppl", str(tmp_path / "nope"), "--data",
                                      str(tmp_path / "missing.txt")])
    assert isinstance(result.exception, LLMAccelError)
    assert "missing.txt" in str(result.exception)


@pytest.mark.slow
def test_eval_ppl_backends_agree_on_smollm2(smollm2_gguf, tmp_path):
    """The real model both ways (each GGUF load takes about 30 s on 2 CPU cores)."""
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    args = [str(smollm2_gguf), "--data", str(text), "--context", "64", "--limit", "2",
            "--device", "cpu", "--dtype", "float32"]
    ours, theirs = _ppl_json(*args), _ppl_json(*args, "--backend", "hf")
    assert ours["scored_tokens"] == theirs["scored_tokens"] == 126
    assert theirs["ppl"] == pytest.approx(ours["ppl"], rel=1e-4)


def _ppl_vs_hf_module():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "ppl_vs_hf.py"
    spec = importlib.util.spec_from_file_location("ppl_vs_hf", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ppl_vs_hf_script_on_a_tiny_model(tiny_with_tokenizer, tmp_path, wikitext_dir,
                                          monkeypatch):
    """benchmarks/ppl_vs_hf.py end to end (generated text in WikiText's layout through a
    word-level tokenizer, two short windows): records in the format of docs/workloads.md, the
    difference computed from them."""
    from dataclasses import replace

    from llmaccel.bench.results import read_jsonl

    monkeypatch.setenv("LLMACCEL_DATA_DIR", str(wikitext_dir))

    mod = _ppl_vs_hf_module()
    out = tmp_path / "out"
    assert mod.main(["--model", str(tiny_with_tokenizer), "--name", "tiny", "--context", "64",
                     "--limit", "2", "--out", str(out)]) == 0
    (jsonl,) = out.glob("*-W6-ppl-vs-hf-tiny.jsonl")
    recs = read_jsonl(jsonl)
    assert [r.backend for r in recs] == ["llmaccel", "hf-eager"]
    for r in recs:
        assert (r.workload, r.metric, r.model, r.device) == ("W6", "ppl", "tiny", "cpu")
        c = r.config
        assert (c["context"], c["stride"], c["joining"], c["limit"]) == (64, 64, "hf", 2)
        assert (c["windows"], c["scored_tokens"], c["dtype"]) == (2, 126, "float32")
        assert r.value == pytest.approx(math.exp(c["nll"]), abs=1e-3)
    rel = (math.exp(recs[1].config["nll"] - recs[0].config["nll"]) - 1) * 100
    assert abs(rel) < 0.01
    md = jsonl.with_suffix(".md").read_text()
    assert f"{rel:+.4f}%" in md and "within 0.1%: yes" in md and "Partial" in md
    # a difference beyond the tolerance says so
    far = replace(recs[1], config={**recs[1].config, "nll": recs[0].config["nll"] + 0.01})
    assert "within 0.1%: NO" in mod.markdown([recs[0], far], "cmd")
    assert "+1.0050%" in mod.markdown([recs[0], far], "cmd")
