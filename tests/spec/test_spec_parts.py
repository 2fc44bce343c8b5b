"""The parts of speculative decoding around the verifier: n-gram prompt lookup, the adaptive
choice of k, the acceptance counters and the config's errors (the off switch:
test_spec_switch.py, its n-gram shadow: test_spec_shadow.py)."""

from __future__ import annotations

import math
import random

import pytest

from llmaccel.spec import SpecDecodeStats, SpeculativeConfig, SpeculativeConfigError
from llmaccel.spec.adaptive import AcceptanceTracker, best_k, expected_tokens, speedup_bound
from llmaccel.spec.ngram import ngram_propose


def test_ngram_takes_what_followed_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    ctx = [5, 6, 7, 8, 1, 5, 6, 9, 2, 3, 5, 6]
    # suffix [5, 6] occurs at 0 and 5: the latest (5) wins -> 9, 2, 3
    assert ngram_propose(ctx, 3, 1, 2) == [9, 2, 3]
    # a longer suffix [3, 5, 6] has no earlier match; max_n 3 falls back to n = 2
    assert ngram_propose(ctx, 3, 1, 3) == [9, 2, 3]
    # only n >= 3 allowed: nothing recurs
    assert ngram_propose(ctx, 3, 3, 4) == []
    # never past the end of the context
    assert ngram_propose([4, 4], 5, 1, 2) == [4]
    assert ngram_propose([1], 3, 1, 2) == []


def test_ngram_prefers_a_longer_match_over_a_later_one():
    ctx = [1, 2, 3, 10, 11, 9, 3, 20, 1, 2, 3]
    # [1, 2, 3] matched at 0 -> 10, 11; the later single [3] at 6 would say 20
    assert ngram_propose(ctx, 2, 1, 3) == [10, 11]
    assert ngram_propose(ctx, 2, 1, 1) == [20, 1]


def test_ngram_on_a_copied_span_drafts_the_copy():
    """An edit that copies its input: once the copy starts, lookup drafts the rest of it."""
    rng = random.Random(0)
    source = [rng.randrange(1000) for _ in range(200)]
    ctx = source + [7, 7] + source[:50]
    assert ngram_propose(ctx, 5, 2, 4) == source[50:55]
    assert [ngram_propose(ctx, k, 2, 4) for k in (2, 0)] == [source[50:52], []]


def _ngram_by_windows(ctx, k, min_n, max_n):
    """The definition, slowly: slide a window of each length n (longest first) over the
    context before its last token; the latest window equal to the n-token suffix wins."""
    length = len(ctx)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = [s for s in range(length - n) if ctx[s:s + n] == ctx[length - n:]]
        if hits:
            start = hits[-1] + n
            return ctx[start:start + k]
    return []


def test_ngram_lookup_equals_the_window_definition():
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        assert ngram_propose(ctx, k, lo, hi) == _ngram_by_windows(ctx, k, lo, hi), ctx


def test_ngram_index_equals_the_lookup_as_a_sequence_grows():
    """The engine's incremental index gives `ngram_propose`'s drafts at every step of a
    growing sequence, whatever the step sizes (one token, a run of accepted drafts)."""
    from llmaccel.engine.sampling_params import SamplingParams
    from llmaccel.engine.sequence import Sequence
    from llmaccel.spec.ngram import NgramIndex

    rng = random.Random(1)
    for _ in range(200):
        vocab = rng.choice([2, 3, 6, 30])
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        seq = Sequence("r", 0, [rng.randrange(vocab) for _ in range(rng.randint(1, 12))],
                       SamplingParams())
        index = NgramIndex(lo, hi)
        for _ in range(rng.randint(1, 12)):
            k = rng.randint(1, 5)
            assert index.propose(seq, k) == ngram_propose(seq.all_token_ids, k, lo, hi)
            seq.output_token_ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]


def test_ngram_indexes_kept_current_while_the_gpu_runs():
    """SpecDecoder.index_running updates a 1/INDEX_SPREAD share of the running sequences per
    call, round robin: after INDEX_SPREAD calls every sequence is indexed up to its
    next-to-last token, and proposals interleaved with such updates (and with growth between
    them) equal a fresh lookup's."""
    from llmaccel.engine.sampling_params import SamplingParams
    from llmaccel.engine.sequence import Sequence
    from llmaccel.spec.decoder import INDEX_SPREAD, SpecDecoder
    from llmaccel.spec.config import SpeculativeConfig

    rng = random.Random(2)
    spec = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                         prompt_lookup_min=1, prompt_lookup_max=3),
                       max_model_len=4096, stop_checker=None)
    running = [Sequence(f"r{i}", 0, [rng.randrange(5) for _ in range(rng.randint(1, 30))],
                        SamplingParams()) for i in range(21)]
    for _ in range(INDEX_SPREAD):
        spec.index_running(running)
    for seq in running:
        assert seq.ngram_index.indexed == seq.num_tokens - 1
    for step in range(60):
        for seq in running:
            seq.output_token_ids += [rng.randrange(5) for _ in range(rng.randint(1, 3))]
        spec.index_running(running)
        if step % 7 == 0:
            for seq in running:
                assert seq.ngram_index.propose(seq, 4) == ngram_propose(seq.all_token_ids,
                                                                        4, 1, 3)


def test_expected_tokens_and_the_best_k():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert math.isclose(expected_tokens(0.5, 2), 1 + 0.5 + 0.25)
    assert math.isclose(speedup_bound(0.5, 2, 0.25), 1.75 / 1.5)
    assert best_k(0.9, 0.0, 8) == 8      # free drafts: draft as many as allowed
    assert best_k(0.05, 0.3, 8) == 0     # rarely accepted, costly: do not speculate
    k_mid = best_k(0.7, 0.2, 8)
    assert 1 <= k_mid < 8
    assert all(speedup_bound(0.7, k_mid, 0.2) >= speedup_bound(0.7, k, 0.2) for k in range(9))


def test_step_costs_from_graph_times():
    from llmaccel.spec.costs import StepCosts, constant_cost_fn

    # a row count between captured sizes pays for the next graph; past the largest, linear
    costs = StepCosts({1: 2.0, 2: 2.0, 4: 2.2, 8: 2.4, 16: 4.0},
                      draft_ms={1: 1.0, 2: 1.0, 4: 1.1, 8: 1.2, 16: 2.0})
    assert costs.cost(1, 0) == 1.0
    assert math.isclose(costs.cost(1, 2), (2.2 + 2 * 1.0) / 2.0)       # 3 rows -> graph 4
    assert math.isclose(costs.cost(4, 4), (4.0 * 20 / 16 + 4 * 1.1) / 2.2)  # 20 rows: linear
    fn = costs.cost_fn(1)
    assert fn(2) == costs.cost(1, 2)
    assert constant_cost_fn(0.25)(4) == 2.0
    # best_k with a measured cost function: cheap at batch 1, not worth it at batch 8
    assert best_k(0.8, costs.cost_fn(1), 4) > 0
    assert best_k(0.8, costs.cost_fn(8), 4) == 0


def test_acceptance_tracker_follows_recent_steps():
    t = AcceptanceTracker()
    for _ in range(20):
        t.observe(4, 4)
    assert t.alpha > 0.95 and t.next_k(0.1, 6) == 6
    for _ in range(20):
        t.observe(4, 0)
    assert t.alpha < 0.1
    assert t.next_k(0.3, 6) == 1  # keeps probing with one draft
    assert t.next_k(0.3, 6, min_k=0) == 0
    before = t.alpha
    t.observe(0, 0)  # a step without drafts says nothing
    assert t.alpha == before


def test_spec_decode_stats():
    s = SpecDecodeStats()
    s.observe(4, 4)
    s.observe(4, 1)
    s.observe(2, 0)
    s.observe(0, 0)
    assert (s.num_steps, s.num_draft_tokens, s.num_accepted_tokens) == (3, 10, 5)
    assert s.num_emitted_tokens == 8 and s.num_rollbacks == 2
    assert s.acceptance_rate == 0.5
    assert math.isclose(s.mean_accepted_len, 8 / 3)
    assert s.per_position_acceptance == [2 / 3, 1 / 3, 0.5, 0.5]
    other = SpecDecodeStats()
    other.observe(5, 5)
    s.merge(other)
    assert s.drafted_per_position == [4, 4, 3, 3, 1] and s.accepted_per_position[4] == 1
    assert s.as_dict()["num_steps"] == 4


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "medusa"}, "method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "draft"}, "needs `model`"),
    ({"method": "ngram", "model": "x"}, "takes no `model`"),
    ({"draft_confidence_threshold": 1.0}, "draft_confidence_threshold"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_config_errors_name_the_setting(kwargs, match):
    with pytest.raises(SpeculativeConfigError, match=match):
        SpeculativeConfig(**kwargs)


def test_speculation_switches_off_above_the_batch_size():
    cfg = SpeculativeConfig(method="draft", model="m", disable_by_batch_size=16)
    assert cfg.speculate_at(15) and not cfg.speculate_at(16)
    assert SpeculativeConfig().speculate_at(10_000)
