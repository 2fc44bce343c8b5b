"""Speculative decoding inside the engine (n-gram drafts): stops and max_tokens inside a run of
accepted drafts, batches that mix greedy, seeded sampling, logprobs and min_tokens, the batch
size above which speculation switches off, and the acceptance counters in the outputs. (Greedy
equality with transformers under prefix caching, chunked prefill and preemption is in the
engine matrix: the spec-ngram modes.)"""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model, save_word_tokenizer, tiny_configs

from llmaccel import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "adaptive": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-tiny")
    make_tiny_model(tiny_configs()["qwen2"], d, seed=1)
    return str(d)


def _llm(model: str, spec: dict | None = SPEC, **kw) -> LLM:
    return LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True,
               speculative_config=spec, **kw)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 3, 9, 3, 3, 9], list(range(20, 40)) * 2]


def test_stops_and_max_tokens_inside_accepted_drafts(tiny):
    """A stop id or max_tokens reached in the middle of a verified run ends the output there,
    exactly as decoding one token at a time does."""
    plain = _llm(tiny, None)
    spec = _llm(tiny)
    base = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)
    for out in base:
        toks = out.outputs[0].token_ids
        stop = toks[len(toks) // 2]  # a token the greedy output does produce
        for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                      stop_token_ids=[stop]),
                       SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)):
            want = plain.generate([out.prompt_token_ids], params, use_tqdm=False)[0].outputs[0]
            got = spec.generate([out.prompt_token_ids], params, use_tqdm=False)[0].outputs[0]
            assert got.token_ids == want.token_ids
            assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    stats = spec.get_stats().spec_decode
    assert stats["num_accepted_tokens"] > 0
    assert spec.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer (w0 .. w29): text, so stop strings."""
    d = tmp_path_factory.mktemp("spec-worded")
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = save_word_tokenizer([f"w{i}" for i in range(30)], d)
    cfg.eos_token_id = 1
    make_tiny_model(cfg, d, seed=2)
    return str(d)


def test_stop_strings_in_a_batch_with_drafts(worded):
    """Many requests in one batch, each ending at a stop string found in its greedy output,
    while the others go on verifying drafts: every output (ids, text, finish, logprob) equals
    decoding without speculation. (A request that met its stop string while its drafts were
    being verified once shifted the logits rows of every request after it in the batch; and
    tokens accepted after the stop string's token stayed in the output ids.)"""
    prompts = [" ".join(f"w{(i * 7 + j * (i % 3 + 1)) % 30}" for j in range(12)) * 2
               for i in range(16)]
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)
    plain = LLM(worded, **kw)
    spec = LLM(worded, speculative_config=SPEC, **kw)
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)
    params = []
    for i, out in enumerate(free):
        words = out.outputs[0].text.split()
        # a word the greedy output produces, early for some requests and late for others
        params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                     stop=[words[min(len(words) - 1, 3 + 5 * (i % 6))]]))
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert sum(w.outputs[0].finish_reason == "stop" for w in want) >= 12
    for i, (w, g) in enumerate(zip(want, got)):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids, i
        assert (g.text, g.finish_reason, g.stop_reason) == (w.text, w.finish_reason,
                                                            w.stop_reason), i
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3), i
    stats = spec.get_stats().spec_decode
    assert stats["num_accepted_tokens"] > 0, stats
    assert spec.engine.block_manager.num_used_blocks == 0


def test_mixed_batch_greedy_sampled_logprobs_min_tokens(tiny):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=10)]
    llm = _llm(tiny)
    first = llm.generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)
    again = _llm(tiny).generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)
    plain = _llm(tiny, None).generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)
    # greedy rows equal decoding without speculation; the seeded sampled row is reproducible
    for i in (0, 2, 3):
        assert first[i].outputs[0].token_ids == plain[i].outputs[0].token_ids, i
    assert first[1].outputs[0].token_ids == again[1].outputs[0].token_ids
    assert len(first[1].outputs[0].token_ids) == 24
    assert len(first[2].outputs[0].logprobs) == 24  # logprobs rows decode without drafts
    assert first[2].metrics.spec_decode["num_draft_tokens"] == 0
    assert first[0].metrics.spec_decode["num_draft_tokens"] > 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_speculation_switches_off_at_the_batch_size(tiny):
    prompts = PROMPTS * 2
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    off = _llm(tiny, {**SPEC, "disable_by_batch_size": 2})
    outs = off.generate(prompts, params, use_tqdm=False)
    # six requests decode together from the first step: none of them drafts
    assert off.get_stats().spec_decode["num_draft_tokens"] == 0
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in _llm(tiny, None).generate(prompts, params,
                                                                  use_tqdm=False)]


def test_disable_by_batch_size_bounds_the_automatic_switch(tiny):
    """With measured step costs (the automatic switch on) and disable_by_batch_size=4: a batch
    of six does no speculative work at all -- no drafts, no n-gram index, no switch rounds or
    measurements, every step after the first launched ahead -- while a single request is still
    the switch's to decide (here: on). Outputs equal plain greedy either way."""
    from llmaccel.spec.costs import StepCosts

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _llm(tiny, None)
    for prompts, limited in ((PROMPTS * 2, True), (PROMPTS[:1], False)):
        llm = _llm(tiny, {**SPEC, "disable_by_batch_size": 4})
        spec = llm.engine.spec
        # verification free, plain decoding slow at its best: the switch would speculate
        spec.costs = StepCosts({r: 1e6 for r in (1, 2, 4, 8, 16, 32, 64)})
        assert spec.automatic
        seen = []
        engine_add = llm.engine.scheduler.add

        def add(seq, engine_add=engine_add, seen=seen):
            seen.append(seq)
            engine_add(seq)
        llm.engine.scheduler.add = add
        outs = llm.generate(prompts, params, use_tqdm=False)
        want = plain.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        stats = llm.get_stats()
        if limited:
            assert stats.spec_decode["num_draft_tokens"] == 0
            assert spec.switch.round == 0 and not spec.monitor._rates
            assert all(seq.ngram_index is None for seq in seen) and len(seen) == 6
            assert stats.num_async_steps >= params.max_tokens - 3
        else:
            assert stats.spec_decode["num_draft_tokens"] > 0 and spec.switch.round > 0


def test_measured_costs_switch_speculation_off_where_it_does_not_pay(tiny):
    """With step costs (as the engine measures them on a GPU) that make verification dear at
    batch >= 4, a batch of six runs plain decoding (async scheduling included, rare probe
    rounds aside) and a single request speculates; outputs equal plain greedy. Once
    speculative steps ran, their measured throughput is compared with plain decoding's
    (measured, or 1 / graph time before that): the graph times, and the measured time of
    speculative steps, are scaled so that this CPU loses (batch 6: plain graphs of 1 us,
    speculative steps timed 1000x) or wins (batch 1: plain graphs of 1000 s, speculative steps
    timed 1/1000x) those comparisons as the case needs."""
    from llmaccel.spec.costs import StepCosts

    # ms per graph of R rows: flat up to 4 rows (weight-bound), then linear (compute-bound)
    shape = {1: 1.0, 2: 1.0, 4: 1.0, 8: 2.2, 16: 4.4, 32: 8.8, 64: 17.6}
    # k = 1 at batch 6 costs as much as the at most 2 tokens it can emit: off at any acceptance
    assert StepCosts(shape).cost(1, 3) == 1.0 and StepCosts(shape).cost(6, 1) == 2.0
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _llm(tiny, None)
    for prompts, speculates, scale in ((PROMPTS * 2, False, 1e-3), (PROMPTS[:1], True, 1e6)):
        llm = _llm(tiny, SPEC)
        spec = llm.engine.spec
        spec.costs = StepCosts({r: t * scale for r, t in shape.items()})
        record = spec.record_step

        def scaled(kind, tokens, seconds, steady=True, record=record, scale=scale):
            record(kind, tokens, seconds / scale if kind and kind[1] else seconds, steady)
        spec.record_step = scaled
        outs = llm.generate(prompts, params, use_tqdm=False)
        want = plain.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        stats = llm.get_stats()
        spec = stats.spec_decode
        if speculates:
            assert spec["num_off_steps"] == 0 and spec["num_draft_tokens"] > 0, spec
        else:
            assert spec["num_off_steps"] > 0 and stats.num_async_steps > 0, spec
            # drafts only in the rare probe rounds (and the last steps, once few are left)
            assert spec["num_draft_tokens"] < 0.25 * sum(len(o.outputs[0].token_ids)
                                                        for o in outs), spec


def test_plain_rounds_are_probed_while_speculation_is_on(tiny):
    """Where speculation was measured faster and stays on, probes decode a few rounds plainly
    (async scheduling included) to measure plain decoding again: a plain rate measured once
    must not stand forever (a slow one kept a draft model on at 0.64x plain on an H100).
    Outputs equal plain greedy."""
    from llmaccel.spec.switch import PROBE_EVERY
    from llmaccel.spec.costs import StepCosts

    params = SamplingParams(temperature=0, max_tokens=4 * PROBE_EVERY, ignore_eos=True)
    prompt = [[1, 2, 3, 4]]  # little to look up: short runs of drafts, many rounds
    llm = _llm(tiny, SPEC)
    spec = llm.engine.spec
    # plain decoding "at its best" is slow, verifying up to 8 rows costs a decode step: speculate
    spec.costs = StepCosts({1: 1e6, 8: 1e6})
    outs = llm.generate(prompt, params, use_tqdm=False)
    want = _llm(tiny, None).generate(prompt, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    stats = llm.get_stats()
    assert stats.spec_decode["num_off_steps"] > 0 and stats.num_async_steps > 0
    assert spec.monitor.rate(1, True) is not None and spec.monitor.rate(1, False) is not None


def test_adaptive_k_backs_off_when_drafts_fail(tiny):
    """With the adaptive k, a request whose drafts keep failing drafts fewer tokens: fewer
    drafts per verify step than the fixed k."""
    prompt = [[(7 * i) % 50 + 1 for i in range(60)]]  # 1-gram repeats, little true structure
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=64, ignore_eos=True)
    fixed = _llm(tiny, {**SPEC, "prompt_lookup_min": 1, "prompt_lookup_max": 1})
    adaptive = _llm(tiny, {**SPEC, "prompt_lookup_min": 1, "prompt_lookup_max": 1,
                           "adaptive": True, "draft_cost_ratio": 0.3})
    fixed.generate(prompt, params, use_tqdm=False)
    adaptive.generate(prompt, params, use_tqdm=False)
    f, a = fixed.get_stats().spec_decode, adaptive.get_stats().spec_decode
    assert f["acceptance_rate"] < 0.5
    assert a["num_draft_tokens"] / a["num_steps"] < f["num_draft_tokens"] / f["num_steps"]


def test_unknown_speculative_method_is_a_clear_error(tiny):
    from llmaccel.errors import LLMAccelError
    from llmaccel.spec import SpeculativeConfigError

    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens"):
        _llm(tiny, {"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(LLMAccelError, match="is not a draft head"):
        _llm(tiny, {"method": "head", "model": tiny})


def test_rounds_where_requests_finish_are_not_measured(tiny):
    """A request that stops on a stop id while the next plain step was already launched
    (async scheduling) has that step's token dropped: the round emits fewer tokens than it
    computed, and it carries the request's teardown. The switch's rates never see such
    rounds, so every measured round emits at least a token per sequence."""
    from llmaccel.spec.costs import StepCosts

    plain = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3
    outs = _llm(tiny, None).generate(PROMPTS, plain, use_tqdm=False)
    params = []
    for o, p in zip(outs, plain):  # each request stops at its first new token past the 6th
        ids = o.outputs[0].token_ids
        stop = next(t for i, t in enumerate(ids) if i >= 6 and t not in ids[:i])
        params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                     stop_token_ids=[stop]))
    llm = _llm(tiny, SPEC)
    spec = llm.engine.spec
    # verifying k >= 1 drafts for 3 sequences costs 2.2 decode steps (graphs: 4 rows 1 us,
    # 8 rows 2.2 us): the cost model keeps speculation off at batch 3 at any acceptance
    spec.costs = StepCosts({1: 1e-3, 2: 1e-3, 4: 1e-3, 8: 2.2e-3, 16: 4.4e-3})
    seen = []
    observe = spec.monitor.observe

    def record(batch, speculative, tokens, seconds, observe=observe):
        seen.append((batch, speculative, tokens))
        observe(batch, speculative, tokens, seconds)
    spec.monitor.observe = record
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    assert llm.get_stats().num_async_steps > 0
    assert seen and all(tokens >= 1.0 for _, _, tokens in seen), seen
