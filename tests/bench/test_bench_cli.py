"""`llmaccel bench` end to end on a tiny random model on the CPU: each workload writes records
in BENCHMARKS.md's format, per-request rows, and a markdown summary; numbers are checked for
consistency with the request rows they came from (not for speed)."""

from __future__ import annotations

import json
import statistics

import pytest
from typer.testing import CliRunner

from llmaccel.cli import app
from tiny_models import make_tiny_model, tiny_configs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench-tiny")
    make_tiny_model(tiny_configs()["llama"], d)
    return d


def _bench(*args: str):
    r = CliRunner().invoke(app, ["bench", *args, "--no-progress"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r


def _read(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _by(records, **match):
    return {r["metric"]: r for r in records
            if all(r["config"].get(k) == v or r.get(k) == v for k, v in match.items())}


def test_latency_llmaccel_and_hf_eager(tiny, tmp_path):
    _bench("latency", str(tiny), "--backend", "llmaccel,hf-eager", "--quick", "--repeats", "2",
           "--dtype", "float32", "--out", str(tmp_path), "--name", "w1")
    recs = _read(tmp_path / "w1.jsonl")
    rows = _read(tmp_path / "w1.requests.jsonl")
    for backend in ("llmaccel", "hf-eager"):
        m = _by(recs, backend=backend)
        mine = [r for r in rows if r["backend"] == backend]
        assert len(mine) == 2 and all(r["output_len"] == 16 for r in mine)
        # tok_s is the median over repeats of new tokens / E2E latency
        expect = statistics.median(16 / (r["e2e_ms"] / 1e3) for r in mine)
        assert m["tok_s"]["value"] == pytest.approx(expect, rel=2e-3)
        assert m["ttft_ms_p50"]["value"] == pytest.approx(
            statistics.median(r["ttft_ms"] for r in mine), rel=2e-3)
        assert 0 < m["pct_roofline"]["value"] and m["gbps"]["config"]["copy_method"]
        assert m["tok_s"]["config"]["prompt_len"] == 16 and m["tok_s"]["device"]
    assert _by(recs, backend="hf-eager")["tok_s"]["load_format"] == "dummy"
    assert "W1 latency" in (tmp_path / "w1.md").read_text()


def test_throughput_and_serve(tiny, tmp_path):
    _bench("throughput", str(tiny), "--quick", "--repeats", "2", "--dtype", "float32",
           "--out", str(tmp_path), "--name", "w2", "--usd-per-gpu-hour", "3")
    m = _by(_read(tmp_path / "w2.jsonl"))
    assert m["completed"]["value"] == 4 and m["failed"]["value"] == 0
    assert len(m["out_tok_s"]["config"]["repeats"]) == 2
    # the median of the repeats, to the records' precision: values and repeats are each
    # rounded to 3 decimals (make_record, engine_runs._r), and two repeats' median is their
    # mean, which can differ from the rounded median of the unrounded rates by up to 1e-3
    assert m["out_tok_s"]["value"] == pytest.approx(statistics.median(
        m["out_tok_s"]["config"]["repeats"]), abs=1e-3)
    assert m["usd_per_m_out_tok"]["value"] > 0
    rows = _read(tmp_path / "w2.requests.jsonl")
    assert len(rows) == 8 and {r["repeat"] for r in rows} == {0, 1}
    assert all(r["output_len"] == 8 for r in rows)

    _bench("serve", str(tiny), "--quick", "--request-rate", "50,inf", "--dtype", "float32",
           "--out", str(tmp_path), "--name", "w3", "--goodput", "e2el:600000")
    recs = _read(tmp_path / "w3.jsonl")
    for load in ("rate=50", "all-at-once"):
        m = _by(recs, load=load)
        assert m["completed"]["value"] == 8 and m["goodput"]["value"] > 0
        assert m["total_tok_s"]["value"] > m["out_tok_s"]["value"] > 0
    rows = _read(tmp_path / "w3.requests.jsonl")
    assert len(rows) == 16
    # output lengths follow W3's U(output_min, output_max) draw (quick: 4..12), not max_tokens
    assert len({r["output_len"] for r in rows}) > 1 and all(4 <= r["output_len"] <= 12
                                                         for r in rows)


def test_prefix_cache_off_and_on(tiny, tmp_path):
    _bench("prefix", str(tiny), "--quick", "--repeats", "1", "--dtype", "float32",
           "--out", str(tmp_path), "--name", "w4")
    recs = _read(tmp_path / "w4.jsonl")
    off, on = _by(recs, variant="prefix-cache-off"), _by(recs, variant="prefix-cache-on")
    assert off["ttft_ms_p50"]["config"]["engine_kwargs"]["enable_prefix_caching"] is False
    assert on["ttft_ms_p50"]["config"]["engine_kwargs"]["enable_prefix_caching"] is True
    assert off["completed"]["value"] == on["completed"]["value"] == 4
    assert "prefix-cache-off / prefix-cache-on" in (tmp_path / "w4.md").read_text()


def test_a_failing_backend_is_reported_and_the_others_run(tiny, tmp_path):
    r = _bench("latency", str(tiny), "--backend", "openai,llmaccel", "--base-url",
               "http://127.0.0.1:9", "--quick", "--repeats", "1", "--dtype", "float32",
               "--out", str(tmp_path), "--name", "mixed")
    recs = _read(tmp_path / "mixed.jsonl")
    assert {r["backend"] for r in recs} == {"llmaccel"}
    assert "openai:server" in (tmp_path / "mixed.md").read_text()
    assert "vocabulary" in r.output  # the server side needed --vocab-size


def test_device_option_reaches_every_local_backend(tiny, tmp_path):
    import torch

    from llmaccel.bench import hardware as hw

    _bench("latency", str(tiny), "--backend", "llmaccel,hf-eager", "--quick", "--repeats", "1",
           "--dtype", "float32", "--device", "cpu", "--out", str(tmp_path), "--name", "cpu")
    recs = _read(tmp_path / "cpu.jsonl")
    assert {r["device"].split(" ")[0] for r in recs} == {"cpu"}
    assert _by(recs, backend="llmaccel")["tok_s"]["config"]["engine_kwargs"]["device"] == "cpu"
    for bad, why in (("tpu", "--device: "), ("cuda", "no CUDA GPU")):
        if bad == "cuda" and torch.cuda.is_available():
            continue
        r = CliRunner().invoke(app, ["bench", "latency", str(tiny), "--quick", "--device", bad,
                                     "--out", str(tmp_path), "--no-progress"])
        assert r.exit_code != 0 and why in r.output + str(r.exception)
    hw.use_device(None)  # the choice is per command: leave the default for later tests


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """A tiny model with a word-level tokenizer over W5's prompts (text prompts need one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from llmaccel.bench.spec_prompts import PROMPTS

    d = tmp_path_factory.mktemp("bench-worded")
    words = sorted({w for texts in PROMPTS.values() for t in texts for w in t.split()})
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(d)
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = len(vocab)
    cfg.eos_token_id = 1
    make_tiny_model(cfg, d)
    return d


def test_spec_ngram_against_plain(worded, tmp_path):
    _bench("spec", str(worded), "--batches", "1,2", "--kinds", "prose", "--max-tokens", "12",
           "--repeats", "1", "--dtype", "float32", "--max-model-len", "512",
           "--out", str(tmp_path), "--name", "w5")
    recs = _read(tmp_path / "w5.jsonl")
    assert {(r["config"]["batch"], r["metric"]) for r in recs} == {
        (b, m) for b in (1, 2) for m in ("speedup", "acceptance_rate", "mean_accepted_len",
                                         "out_tok_s")}
    for r in recs:
        c = r["config"]
        assert c["identical_to_plain"] is True  # greedy speculation is lossless
        counts = c["spec_counters"]
        if r["metric"] == "acceptance_rate" and counts["num_draft_tokens"]:
            assert r["value"] == pytest.approx(counts["num_accepted_tokens"]
                                               / counts["num_draft_tokens"], abs=1e-3)
            assert sum(counts["drafted_per_position"]) == counts["num_draft_tokens"]
        if r["metric"] == "speedup":
            walls = c["walls_plain_ms"][0] / c["walls_spec_ms"][0]
            assert r["value"] == pytest.approx(walls, rel=1e-2)
