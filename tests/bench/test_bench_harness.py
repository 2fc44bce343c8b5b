"""The GPU-speed benchmark harness on CPU: record format, markdown ratios, workload prompts,
roofline arithmetic, and benchmarks/gpu_speed.py --quick end to end on a tiny model."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model, tiny_configs
from transformers import AutoModelForCausalLM

from llmaccel.analyze import FORMATS
from llmaccel.analyze import weight_bytes as analyzed_weight_bytes
from llmaccel.bench import hardware as hw
from llmaccel.bench import workloads as wl
from llmaccel.bench.results import (
    Failure,
    Record,
    RunMeta,
    current_commit,
    guarded,
    make_record,
    ratio_lines,
    read_jsonl,
    summary_markdown,
    write_jsonl,
)
from llmaccel.models.transformer import TransformerForCausalLM

REPO = Path(__file__).resolve().parents[2]
META = RunMeta("NVIDIA H200", "2.11.0", "abc123", "python benchmarks/gpu_speed.py --x")
BF16 = FORMATS[0]


def _rec(workload, backend, metric, value, **config):
    return make_record(META, workload, "llama-3.2-1b", backend, config, metric, value)


def _gpu_speed():
    spec = importlib.util.spec_from_file_location("gpu_speed", REPO / "benchmarks/gpu_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- results -----------------------------------------------------------------------------------
def test_records_round_trip_in_benchmarks_md_field_order(tmp_path):
    records = [_rec("W1", "llmaccel", "tok_s", 412.04, prompt_len=128),
               _rec("W2", "hf-cb", "out_tok_s", 1198.5, input_len=[100, 1024])]
    path = tmp_path / "r.jsonl"
    write_jsonl(path, records)
    assert read_jsonl(path) == records
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["workload", "model", "load_format", "backend", "config", "metric",
                           "value", "device", "torch", "commit", "command"]
    assert first["load_format"] == "dummy" and first["value"] == 412.04


def test_markdown_ratios_are_computed_from_the_records():
    records = [_rec("W1", "llmaccel", "tok_s", 300.0), _rec("W1", "hf-eager", "tok_s", 100.0),
               _rec("W1", "hf-static-compile", "tok_s", 400.0),
               _rec("W1", "llmaccel", "ttft_ms_p50", 10.0),
               _rec("W1", "hf-eager", "ttft_ms_p50", 25.0),
               _rec("W4", "llmaccel", "ttft_ms_p50", 200.0, variant="prefix-cache-off"),
               _rec("W4", "llmaccel", "ttft_ms_p50", 50.0, variant="prefix-cache-on")]
    lines = ratio_lines(records[:5])
    assert "llmaccel / hf-eager (tok_s) = 3.00×" in lines
    assert "llmaccel / hf-static-compile (tok_s) = 0.75×" in lines
    assert "hf-eager / llmaccel (ttft_ms_p50, lower is better) = 2.50×" in lines
    md = summary_markdown(records, [Failure("W2", "llama-3.2-1b", "hf-cb", "OOM | boom")])
    assert "## W1 — llama-3.2-1b" in md and "## W4 — llama-3.2-1b" in md
    assert "| llmaccel | 300 | 10 |" in md
    assert "llmaccel: prefix-cache-off / prefix-cache-on (ttft_ms_p50) = 4.00×" in md
    assert "| llmaccel [prefix-cache-on] | 50 |" in md
    assert '- hf-cb: {"error": "OOM | boom"}' in md


def test_serving_rows_are_kept_per_load_point_and_divided_only_within_one():
    records = [_rec("W3", "llmaccel", "out_tok_s", 1000.0, load="rate=4"),
               _rec("W3", "llmaccel", "out_tok_s", 4000.0, load="rate=16"),
               _rec("W3", "openai:vllm", "out_tok_s", 500.0, load="rate=4"),
               _rec("W3", "openai:vllm", "out_tok_s", 1000.0, load="rate=16")]
    md = summary_markdown(records)
    assert "| llmaccel @ rate=4 | 1,000 |" in md and "| llmaccel @ rate=16 | 4,000 |" in md
    assert "| openai:vllm @ rate=16 | 1,000 |" in md
    lines = ratio_lines(records)
    assert lines == ["at rate=4: llmaccel / openai:vllm (out_tok_s) = 2.00×",
                     "at rate=16: llmaccel / openai:vllm (out_tok_s) = 4.00×"]


def test_guarded_turns_an_exception_into_a_failure():
    def boom():
        raise RuntimeError("CUDA out of\nmemory")

    out = guarded(boom, "W2", "llama-3.2-1b", "hf-cb")
    assert out.records == []
    assert out.failures == [Failure("W2", "llama-3.2-1b", "hf-cb",
                                    "RuntimeError: CUDA out of memory")]
    ok = guarded(lambda: [_rec("W1", "llmaccel", "tok_s", 1.0)], "W1", "m", "llmaccel")
    assert len(ok.records) == 1 and not ok.failures


def test_commit_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("LLMACCEL_COMMIT", "deadbeef")
    assert current_commit() == "deadbeef"
    monkeypatch.delenv("LLMACCEL_COMMIT")
    assert current_commit()  # git's HEAD here, "unknown" in a copy without .git


# -- workloads ---------------------------------------------------------------------------------
def test_workload_prompts_are_deterministic_and_within_bounds():
    vocab = 128256
    lo, hi = wl.token_range(vocab)
    assert (lo, hi) == (100, 127256)  # Llama 3's special tokens start at 128000
    w1 = wl.w1_prompt(wl.W1Spec(), vocab)
    assert len(w1) == 128 and w1 == wl.w1_prompt(wl.W1Spec(), vocab)
    w2 = wl.w2_prompts(wl.W2Spec(), vocab)
    assert w2 == wl.w2_prompts(wl.W2Spec(), vocab)
    assert len(w2) == 256 and all(100 <= len(p) <= 1024 for p in w2)
    assert len({len(p) for p in w2}) > 100  # lengths really vary
    assert w2 != wl.w2_prompts(wl.W2Spec(seed=1), vocab)
    spec = wl.W4Spec()
    r0, r1 = wl.w4_prompts(spec, vocab, 0), wl.w4_prompts(spec, vocab, 1)
    prefix = wl.w4_prefix(spec, vocab)
    assert len(r0) == 64 and all(len(p) == 2050 and p[:2000] == prefix for p in r0 + r1)
    assert len({tuple(p[2000:]) for p in r0}) == 64  # unique tails
    assert r0 != r1 and r0 == wl.w4_prompts(spec, vocab, 0)
    for p in [w1, *w2, *r0]:
        assert all(lo <= t < hi for t in p)


def test_token_range_and_fitting_for_tiny_models():
    assert wl.token_range(160) == (16, 144)
    assert wl.token_range(5) == (0, 5)
    assert wl.fit_to_length(wl.W4Spec(), 512).max_model_len == 512
    assert wl.fit_to_length(wl.W2Spec(), 1024).input_max == 512
    assert wl.fit_to_length(wl.W1Spec(), 4096) == wl.W1Spec()


# -- hardware / roofline -----------------------------------------------------------------------
def test_roofline_arithmetic_matches_benchmarks_md():
    # BENCHMARKS.md: 4.27 TB/s copy, 2.47 GB (1B) and 6.43 GB (3B) of weights.
    assert hw.roofline_tok_s(4270, 2.47e9) == pytest.approx(1728.7, abs=0.1)
    assert hw.roofline_tok_s(4270, 6.43e9) == pytest.approx(664.1, abs=0.1)
    # gpt-fast: 671 tok/s is 39% of the 1B roofline, 314 tok/s 47% of the 3B one.
    assert hw.pct_roofline(hw.achieved_gbps(2.47e9, 671), 4270) == pytest.approx(38.8, abs=0.05)
    assert hw.pct_roofline(hw.achieved_gbps(6.43e9, 314), 4270) == pytest.approx(47.3, abs=0.05)
    assert hw.bytes_per_decode_step(1e9, 32768, 256) == 1e9 + 8 * 2**20
    assert hw.roofline_tok_s(1000, 1e9, batch=8) == 8000


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_count_what_a_decode_step_reads(tied):
    config = tiny_configs()["llama-tied" if tied else "llama"]
    expected = analyzed_weight_bytes(config, BF16)["decode_read"]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            ours = TransformerForCausalLM(config, 512)
        finally:
            torch.set_default_dtype(old)
    assert hw.weight_bytes(hf) == hw.weight_bytes(ours) == expected
    embed = config.vocab_size * config.hidden_size * 2
    assert hw.weight_bytes(hf, include_untied_input_embedding=True) == \
        expected + (0 if tied else embed)
    # K and V, 2 layers x 2 KV heads x head_dim 16, bf16
    assert hw.kv_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 2 * 16 * 2


def test_copy_bandwidth_on_cpu_is_measured_and_labelled():
    bw = hw.measure_copy_bandwidth("cpu", nbytes=2**20, repeats=3)
    assert bw.gbps > 0 and bw.nbytes == 2**20 and "cpu" in bw.method
    assert hw.device_name("cpu").startswith("cpu")


# -- the CLI end to end ------------------------------------------------------------------------
def test_engine_kw_parsing():
    parse = _gpu_speed().parse_engine_kw
    assert parse(["enforce_eager=true", "max_num_seqs=64", "cudagraph_capture_sizes=[1,2]",
                  "attention_backend=torch", "gpu_memory_utilization=0.5"]) == {
        "enforce_eager": True, "max_num_seqs": 64, "cudagraph_capture_sizes": (1, 2),
        "attention_backend": "torch", "gpu_memory_utilization": 0.5}
    with pytest.raises(SystemExit):
        parse(["no_such_knob=1"])


def test_gpu_speed_quick_end_to_end_on_cpu(tmp_path):
    model_dir = tmp_path / "tiny"
    make_tiny_model(tiny_configs()["llama-tied"], model_dir)
    out = tmp_path / "out"
    argv = ["--quick", "--workloads", "W1,W2,W4", "--shapes", str(model_dir),
            "--backends", "llmaccel,hf-eager", "--dtype", "float32", "--out", str(out),
            "--name", "quick"]
    assert _gpu_speed().main(argv) == 0
    records = read_jsonl(out / "quick.jsonl")
    by_key = {(r.workload, r.row, r.metric): r for r in records}
    assert set(by_key) == {
        ("W1", "llmaccel", m) for m in ("tok_s", "decode_tok_s", "ttft_ms_p50", "gbps",
                                         "pct_roofline")
    } | {("W1", "hf-eager", m) for m in ("tok_s", "gbps", "pct_roofline")} | {
        ("W2", "llmaccel", "out_tok_s")} | {
        ("W4", f"llmaccel [{v}]", m) for v in ("prefix-cache-off", "prefix-cache-on")
        for m in ("ttft_ms_p50", "ttft_ms_p95")}
    for r in records:
        assert isinstance(r, Record) and r.value > 0 and r.model == str(model_dir)
        assert r.command.startswith("python benchmarks/gpu_speed.py --quick")
        assert r.device.startswith("cpu") and r.torch == torch.__version__
    w1 = by_key[("W1", "llmaccel", "tok_s")].config
    assert len(w1["repeats"]) == 3 and w1["new_tokens"] == wl.QUICK_W1.new_tokens
    assert "prefill included" in w1["definition"]
    roof = by_key[("W1", "hf-eager", "pct_roofline")].config
    assert roof["weight_bytes"] == analyzed_weight_bytes(
        tiny_configs()["llama-tied"], FORMATS[0])["decode_read"] * 2  # float32
    assert by_key[("W2", "llmaccel", "out_tok_s")].config["output_tokens"] == \
        wl.QUICK_W2.num_requests * wl.QUICK_W2.new_tokens
    on = by_key[("W4", "llmaccel [prefix-cache-on]", "ttft_ms_p50")].config
    off = by_key[("W4", "llmaccel [prefix-cache-off]", "ttft_ms_p50")].config
    assert min(on["mean_cached_tokens"]) >= 48 and max(off["mean_cached_tokens"]) == 0
    md = (out / "quick.md").read_text()
    assert "llmaccel / hf-eager (tok_s) = " in md
    assert "prefix-cache-off / prefix-cache-on (ttft_ms_p50) = " in md
    assert "--quick: tiny sizes" in md and "error" not in md


@pytest.mark.slow
def test_gpu_speed_quick_hf_static_and_cb_on_cpu(tmp_path):
    """The other baselines' plumbing (no compilation on CPU; generate_batch's CPU warm-up
    alone takes about 30 s, hence slow)."""
    model_dir = tmp_path / "tiny"
    make_tiny_model(tiny_configs()["llama-tied"], model_dir)
    argv = ["--quick", "--workloads", "W1,W2", "--shapes", str(model_dir),
            "--backends", "hf-static-compile,hf-cb", "--dtype", "float32",
            "--out", str(tmp_path), "--name", "hf"]
    assert _gpu_speed().main(argv) == 0
    records = {(r.workload, r.backend, r.metric): r for r in read_jsonl(tmp_path / "hf.jsonl")}
    assert records[("W1", "hf-static-compile", "tok_s")].config["cache"] == "static"
    cb = records[("W2", "hf-cb", "out_tok_s")].config
    assert cb["output_tokens"] == wl.QUICK_W2.num_requests * wl.QUICK_W2.new_tokens
