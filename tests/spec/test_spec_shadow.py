"""The automatic off switch's n-gram shadow: acceptance measured while speculation is off, and
the prediction that replaces probes (spec/switch.py)."""

from __future__ import annotations

import math
import random

from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.engine.sequence import Sequence
from llmaccel.spec.decoder import INDEX_SPREAD, SpecDecoder
from llmaccel.spec.config import SpeculativeConfig
from llmaccel.spec.costs import StepCosts
from llmaccel.spec.ngram import NgramIndex, ngram_propose
from llmaccel.spec.switch import (HOLD_ROUNDS, MIN_SHADOW_SAMPLES, PROBE_EVERY,
                                  ShadowAcceptance, SpecSwitch, StepKind)


def _accepted(drafts: list[int], actual: list[int]) -> int:
    n = 0
    for d, t in zip(drafts, actual):
        if d != t:
            break
        n += 1
    return n


def test_shadow_samples_equal_a_lookup_at_that_position_checked_against_what_followed():
    """NgramIndex.shadow at the first unindexed position L: the drafts a fresh lookup over
    the first L tokens proposes (the definition, ngram_propose), and how many of them the
    tokens at L.. confirm; None (index untouched) until k known tokens follow L. Growth of
    random size between calls, over random small vocabularies (many matches)."""
    rng = random.Random(5)
    checked = 0
    for _ in range(200):
        vocab, lo, hi, k = rng.randint(2, 6), rng.randint(1, 2), rng.randint(2, 4), 4
        seq = Sequence("r", 0, [rng.randrange(vocab) for _ in range(rng.randint(1, 20))],
                       SamplingParams())
        index = NgramIndex(lo, hi)
        for _ in range(rng.randint(1, 10)):
            before = index.indexed
            length = before + 1
            sample = index.shadow(seq, k)
            if length < 2:
                assert sample is None and index.indexed == seq.num_tokens - 1
            elif seq.num_tokens - 1 < length + k:
                assert sample is None and index.indexed == before
            else:
                tokens = seq.all_token_ids
                drafts = ngram_propose(tokens[:length], k, lo, hi)
                assert sample == (len(drafts), _accepted(drafts, tokens[length:]))
                assert index.indexed == seq.num_tokens - 1
                checked += 1
            seq.output_token_ids += [rng.randrange(vocab) for _ in range(rng.randint(0, 9))]
        # the index stays a correct index: proposals equal the definition's
        assert index.propose(seq, k) == ngram_propose(seq.all_token_ids, k, lo, hi)
    assert checked > 100


def test_index_running_takes_shadow_samples_only_while_off():
    """While the last round left speculation off, index_running's updates take shadow
    samples (on a copying workload: high acceptance); while on, none."""
    spec = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 4096, None)
    spec.costs = StepCosts({1: 1.0, 8: 1.0, 16: 1.0})
    shadow = spec.switch.shadow
    text = list(range(40))  # each sequence repeats a 40-token text: lookup copies it
    running = [Sequence(f"r{i}", 0, text + text[:5], SamplingParams()) for i in range(16)]

    def grow(steps: int) -> None:
        for _ in range(steps):
            for seq in running:
                seq.output_token_ids.append(text[(seq.num_tokens) % 40])
            spec.index_running(running)

    spec.off = False
    grow(3 * INDEX_SPREAD)
    assert shadow.samples == 0
    spec.off = True
    grow(3 * INDEX_SPREAD)
    assert shadow.samples >= 2 * 16
    tokens, rows = shadow.estimate()
    # every draft of 4 confirmed: 5 tokens a round
    assert math.isclose(tokens, 5.0) and math.isclose(rows, 5.0)


def _switch(acceptance_tokens: float, overhead_s: float) -> tuple[SpecSwitch, ShadowAcceptance]:
    """A switch at batch 8 with plain decoding measured at 1 ms a round (1000 tok/s per
    sequence), graphs of 1 ms up to 8 rows and 2 ms up to 64, speculation measured, then
    switched off, and a shadow reporting `acceptance_tokens` per round with 4 drafts."""
    shadow = ShadowAcceptance()
    sw = SpecSwitch(StepCosts({8: 1.0, 64: 2.0}), prior=lambda b: True, shadow=shadow)
    sw.record_step(None, 0, 0.0)
    for _ in range(4):  # speculative rounds: 40 rows, 2 ms of graph + overhead, 1.5 tok/seq
        sw.record_step(StepKind(8, True, 40), 12, 0.002 + overhead_s)
    assert math.isclose(sw._overhead[8].value, overhead_s, abs_tol=1e-12)
    for _ in range(4):
        sw.record_step(StepKind(8, False, 8), 8, 0.001)
    assert not sw.decide(8)[1]  # 1.5 tokens per 2+ ms: off
    sw.next_round(8, False)
    for _ in range(MIN_SHADOW_SAMPLES + 40):
        shadow.observe(4, round(acceptance_tokens) - 1, 8)
    return sw, shadow


def test_shadow_prediction_switches_on_without_probing_and_holds_after_a_switch_off():
    """Off, with a shadow estimate and the bucket's overhead measured: the prediction (tokens
    per round over graph time of its rows plus overhead) decides, and no speculative probe
    rounds run. A low acceptance keeps it off through every probe slot; a high one turns it
    on; the measured rate then takes over after FRESH_ROUNDS measured rounds."""
    sw, shadow = _switch(acceptance_tokens=1.0, overhead_s=0.0005)
    # predicted: 1 token per (2 ms + 0.5 ms) = 400 tok/s against 1000 plain
    assert math.isclose(sw.predicted_rate(8), 1 / 0.0025)
    decisions = []
    for _ in range(3 * PROBE_EVERY):
        on, chosen = sw.decide(8)
        decisions.append(on)
        sw.next_round(8, chosen)
    assert not any(decisions)  # no probe rounds: the shadow stands in for them
    # copying: 5 tokens per round, 5 rows per sequence (40 rows: 2 ms): 2000 tok/s
    for _ in range(200):
        shadow.observe(4, 4, 8)
    sw.round = sw._hold.get(8, 0)  # past any hold
    assert math.isclose(sw.predicted_rate(8), 5 / 0.0025, rel_tol=0.01)
    on, chosen = sw.decide(8)
    assert on and chosen
    sw.next_round(8, chosen)
    # the stale measured rate (1.5 tok per 2.5 ms) does not switch it off before fresh rounds
    assert sw.decide(8)[1]
    sw.record_step(StepKind(8, False, 8), 8, 0.001)
    sw.record_step(StepKind(8, True, 40), 8 * 5, 0.0025)  # first after the switch: not counted
    assert sw.decide(8)[1]
    for _ in range(2):  # measured: as predicted, 2000 tok/s
        sw.record_step(StepKind(8, True, 40), 8 * 5, 0.0025)
    assert sw.decide(8)[1]
    for _ in range(30):  # acceptance fell: measured 1 token per 2.5 ms: off
        sw.record_step(StepKind(8, True, 40), 8, 0.0025)
    assert not sw.decide(8)[1]
    sw.next_round(8, False)
    # the shadow still says copying (stale), but a switch off by measurement holds
    assert sw.predicted_rate(8) > 1000
    held = [sw.decide(8)[1] for _ in range(1)]
    for _ in range(HOLD_ROUNDS - 2):
        sw.next_round(8, sw.decide(8)[1])
        held.append(sw.decide(8)[1])
    assert not any(held)
    for _ in range(4):
        sw.next_round(8, sw.decide(8)[1])
    assert sw.decide(8)[1]  # the hold is over


def test_without_overhead_or_samples_off_is_probed_as_before():
    """Before the bucket's speculative rounds timed an overhead, or before MIN_SHADOW_SAMPLES,
    there is no prediction: off is probed with speculative rounds."""
    shadow = ShadowAcceptance()
    sw = SpecSwitch(StepCosts({8: 1.0, 64: 2.0}), prior=lambda b: True, shadow=shadow)
    sw.record_step(None, 0, 0.0)
    for _ in range(3):
        sw.record_step(StepKind(8, True, 40), 12, 0.004)
    for _ in range(3):
        sw.record_step(StepKind(8, False, 8), 8, 0.001)
    sw._overhead.clear()
    for _ in range(MIN_SHADOW_SAMPLES):
        shadow.observe(4, 4, 8)
    assert sw.predicted_rate(8) is None
    ons = []
    for _ in range(PROBE_EVERY):
        on, chosen = sw.decide(8)
        ons.append(on)
        sw.next_round(8, chosen)
    assert sum(ons) == 3  # PROBE_LEN speculative rounds


def test_unmeasured_batch_sizes_follow_the_measured_crossover():
    """A bucket without speculative measurements is off when a smaller batch size was
    measured off, on when a larger one was measured on, and asks the cost model otherwise
    (rounds between the prefill chunks of a large batch run at a bucket never measured)."""
    asked = []
    sw = SpecSwitch(StepCosts({b: 1.0 for b in (1, 8, 16, 32, 64)}),
                    prior=lambda b: asked.append(b) or True)
    assert sw.decide(32)[1] and asked == [32]
    sw._mode[16] = False  # measured off at 16
    assert not sw.decide(32)[1] and not sw.decide(64)[1]
    assert sw.decide(8)[1]  # smaller: the cost model
    sw._mode = {64: True}
    assert sw.decide(32)[1] and sw.decide(1)[1]
    assert asked == [32, 8]


def test_the_on_margin_grows_with_what_switching_costs():
    """Off, speculation comes on where it is faster by HYSTERESIS plus twice the bucket's
    measured switch cost over PROBE_EVERY plain rounds: a draft model whose catch-up costs
    10 plain rounds needs ~+68%, a cheap switch ~+5%."""
    from llmaccel.spec.switch import HYSTERESIS

    def switch_with(extra_s: float) -> SpecSwitch:
        sw = SpecSwitch(StepCosts({4: 1.0}), prior=lambda b: True)
        sw.record_step(None, 0, 0.0)
        for _ in range(4):  # plain: a token per 1 ms round
            sw.record_step(StepKind(4, False, 4), 4, 0.001)
        for _ in range(4):  # speculating at 1.3x plain (1.3 tokens per 1 ms round)
            sw.record_step(StepKind(4, True, 8), 4 * 1.3, 0.001)
        sw.record_step(StepKind(4, False, 4), 4, 0.001 + extra_s)  # the switch's first round
        for _ in range(3):
            sw.record_step(StepKind(4, False, 4), 4, 0.001)
        sw._mode[4] = False
        return sw

    cheap, dear = switch_with(0.0), switch_with(0.010)
    assert math.isclose(cheap._margin_on(4), HYSTERESIS)
    assert math.isclose(dear._margin_on(4), HYSTERESIS + 2 * 0.010 / (PROBE_EVERY * 0.001))
    assert cheap.decide(4)[1] and not dear.decide(4)[1]
