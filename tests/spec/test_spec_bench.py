"""benchmarks/spec_bench.py end to end on the CPU (SmolLM2-135M, n-gram, tiny sizes): the W5
records it writes carry the BENCHMARKS.md fields and consistent numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.slow  # ~1 min on SmolLM2; the recipe test runs bench spec on a tiny model
def test_spec_bench_writes_w5_records(smollm2_gguf, tmp_path):
    import spec_bench

    model = smollm2_gguf
    assert spec_bench.main(["--target", str(model), "--methods", "ngram", "--batches", "1,2",
                            "--kinds", "code", "--k", "3", "--max-tokens", "12",
                            "--dtype", "float32", "--repeats", "2", "--name", "w5",
                            "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "w5.jsonl").read_text().splitlines()]
    assert [r["config"]["batch"] for r in records] == [1, 2]
    for r in records:
        assert r["workload"] == "W5" and r["metric"] == "speedup" and r["backend"] == "llmaccel"
        c = r["config"]
        assert c["method"] == "ngram" and c["identical_to_plain"] is True  # fp32: lossless
        assert abs(r["value"] - c["spec_out_tok_s"] / c["plain_out_tok_s"]) < 0.01
        assert 0.0 <= r["acceptance_rate"] <= 1.0 and c["spec_steps"] >= 0
        assert c["monitor_spec_tok_s"] is None  # CPU: no measured step costs, no switch
        # the step trace accounts for every token of the timed runs (2 repeats x batch x 12)
        for steps in (c["steps_plain"], c["steps_spec"]):
            classes = {k: v for k, v in steps.items() if k != "outside_steps_ms"}
            assert sum(v["tokens"] for v in classes.values()) == 2 * c["batch"] * 12
            assert classes["prefill"]["calls"] >= 2 and "spec" not in c["steps_plain"]
        assert ("spec" in c["steps_spec"]) == (c["spec_steps"] > 0)
    assert "| ngram | auto | code | 1 |" in (tmp_path / "w5.md").read_text()


def test_monitor_log_records_what_the_switch_saw_and_counted():
    """--monitor-log: each step shown to the switch, with whether the monitor counted it
    (the first plain step after speculative ones is not); the switch is restored after."""
    import spec_bench

    from llmaccel.spec.costs import StepCosts
    from llmaccel.spec.switch import SpecSwitch, StepKind

    sw = SpecSwitch(StepCosts({4: 1.0}), prior=lambda b: True)
    with spec_bench._MonitorLog(sw) as log:
        sw.record_step(None, 0, 0.001)
        for spec in (True, True, True, False, False):
            sw.record_step(StepKind(4, spec, 12 if spec else 4), 8 if spec else 4, 0.002)
    assert [r[4] for r in log.rows] == [0, 0, 1, 1, 0, 1]
    assert log.rows[1][:4] == [[4, 1, 12], 8, 2.0, 1]
    assert "record_step" not in vars(sw) and "observe" not in vars(sw.monitor)


def test_disable_by_batch_size_flag_per_method():
    """--disable-by-batch-size: one number for every method, or METHOD=N pairs (a method not
    named has no limit); naming a method that is not run is an error."""
    import pytest
    import spec_bench

    assert spec_bench._limits(None, ["ngram", "draft"]) == {}
    assert spec_bench._limits("32", ["ngram", "draft"]) == {"ngram": 32, "draft": 32}
    assert spec_bench._limits("draft=4", ["ngram", "draft"]) == {"draft": 4}
    with pytest.raises(SystemExit, match="head"):
        spec_bench._limits("head=4", ["ngram"])


def test_auto_disable_off_speculates_at_every_batch_size():
    """auto_disable=False (spec_bench --switch on): measured costs, no switch deciding;
    disable_by_batch_size still applies."""
    from llmaccel.spec.decoder import SpecDecoder
    from llmaccel.spec.config import SpeculativeConfig
    from llmaccel.spec.costs import StepCosts

    spec = SpecDecoder(SpeculativeConfig(auto_disable=False, disable_by_batch_size=32), 2048,
                       None)
    spec.costs = StepCosts({1: 1.0, 64: 100.0})
    assert not spec.automatic and spec.speculate_at(16) and not spec.speculate_at(32)


def test_engines_time_in_turns():
    """The plain and speculative engines' timed runs alternate after both warmed up, and each
    gets its own median and walls."""
    import types

    import spec_bench

    calls = []

    class Steps:  # what StepTrace wraps: a step method it replaces and restores
        def step(self):
            return []

    class Engine:
        def __init__(self, name):
            self.name = name
            self.engine = Steps()

        def generate(self, prompts, params, use_tqdm=False):
            calls.append((self.name, params.max_tokens))
            out = types.SimpleNamespace(token_ids=[1, 2])
            return [types.SimpleNamespace(outputs=[out])]

    from llmaccel import SamplingParams
    res = spec_bench._run_alternating([Engine("plain"), Engine("spec")], [[1]],
                                      SamplingParams(max_tokens=16), 3)
    # the warm-up is one whole untimed run each (an 8-token one left compiles in the timed runs)
    assert calls == [("plain", 16), ("spec", 16)] + [("plain", 16), ("spec", 16)] * 3
    assert len(res) == 2
    for median, tokens, _, walls in res:
        assert tokens == [[1, 2]] and len(walls) == 3
        assert abs(median * 1e3 - sorted(walls)[1]) < 0.1


def test_first_difference_names_the_position_and_plain_decodings_logprobs(tmp_path):
    """A speculative run's tokens that leave plain decoding's: the first differing request and
    position, both tokens, and plain decoding's top logprobs there (from the prompt and the
    tokens before it), with their gap when both are among them; None when equal."""
    import spec_bench
    from tiny_models import make_tiny_model, tiny_configs

    from llmaccel import LLM, SamplingParams

    make_tiny_model(tiny_configs()["llama"], tmp_path, seed=5)
    plain = LLM(str(tmp_path), dtype="float32", device="cpu", skip_tokenizer_init=True)
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = plain.generate(prompts, params, use_tqdm=False)
    want = [list(o.outputs[0].token_ids) for o in outs]
    assert spec_bench.first_difference(plain, prompts, want, [list(w) for w in want]) is None
    # request 1 leaves at position 3 for the token plain decoding ranked second there
    ranked = sorted(outs[1].outputs[0].logprobs[3].items(), key=lambda kv: -kv[1])
    second = ranked[1][0]
    got = [list(want[0]), want[1][:3] + [second] + want[1][4:]]
    diff = spec_bench.first_difference(plain, prompts, want, got, top=3)
    assert (diff["request"], diff["index"]) == (1, 3)
    assert (diff["plain_token"], diff["spec_token"]) == (want[1][3], second)
    assert diff["logprob_gap"] == pytest.approx(ranked[0][1] - ranked[1][1], abs=1e-3)
    assert diff["logprob_gap"] >= 0
    # a run cut short: the first missing position, no tokens to compare there
    short = spec_bench.first_difference(plain, prompts, want, [want[0][:2], list(want[1])])
    assert (short["request"], short["index"], short["spec_token"]) == (0, 2, None)
