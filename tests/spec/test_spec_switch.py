"""The automatic off switch (spec/switch.py): measured throughput per batch-size bucket, the
measured choice and its hysteresis, probes and their schedules, and which steps are measured.
(The n-gram shadow that predicts speculation while off: test_spec_shadow.py.)"""

from __future__ import annotations

import math

from llmaccel.spec import SpeculativeConfig


def test_throughput_monitor_buckets_and_decays():
    from llmaccel.spec.costs import ThroughputMonitor, batch_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]
    m = ThroughputMonitor(decay=0.5)
    m.observe(3, True, 100, 1.0)
    assert m.rate(4, True) is None  # one step is not enough
    m.observe(4, True, 300, 1.0)
    assert math.isclose(m.rate(3, True), (0.5 * 100 + 300) / (0.5 * 1.0 + 1.0))
    assert m.rate(8, True) is None  # another bucket
    assert m.rate(4, False) is None  # plain steps are counted apart
    # plain steps age the speculative sums of their bucket: the rate stays, and the next
    # speculative step weighs as much as the decayed history
    m.observe(4, False, 50, 1.0)
    m.observe(4, False, 50, 1.0)
    assert math.isclose(m.rate(4, True), (0.5 * 100 + 300) / (0.5 * 1.0 + 1.0))
    assert math.isclose(m.rate(4, False), 50.0)
    m.observe(4, True, 12, 0.05)  # history weighs 0.5 ** 3 of itself against this step
    assert math.isclose(m.rate(4, True), (0.125 * 350 + 12) / (0.125 * 1.5 + 0.05))
    # a round far slower than the rate counts as OUTLIER times the rate's time for its tokens
    before = m.rate(4, True)
    m.observe(4, True, 10, 100.0)
    clipped = m.OUTLIER * 10 / before
    assert math.isclose(m.rate(4, True), (0.5 * (0.125 * 350 + 12) + 10)
                        / (0.5 * (0.125 * 1.5 + 0.05) + clipped))


def test_measured_throughput_decides_and_off_is_probed():
    from llmaccel.spec.decoder import SpecDecoder
    from llmaccel.spec.switch import PROBE_EVERY, PROBE_LEN
    from llmaccel.spec.costs import StepCosts

    spec = SpecDecoder(SpeculativeConfig(), 2048, None)
    assert not spec.automatic and spec.speculate_at(64)  # no measured costs: always on
    # plain decode steps of 2 ms (batch 1) and 4 ms (batch 8 and more); verifying is free
    spec.costs = StepCosts({1: 2.0, 8: 4.0, 64: 4.0})
    assert spec.automatic
    # the cost model: on (no plain probes before speculation is measured)
    assert all(spec.speculate_at(1, r) for r in range(PROBE_EVERY))
    # measured at batch 1: 10 tokens per 40 ms = 250 tok/s per sequence; plain decoding at
    # its best (the graph's 2 ms) does 500
    for _ in range(3):
        spec.record_step((1, True), 10, 0.04)
    # the first speculative step was not counted, nor is the first after a prefill step
    assert math.isclose(spec.monitor.rate(1, True), 250.0)
    spec.record_step(None, 1, 0.05)
    spec.record_step((1, True), 1, 1.0)
    assert math.isclose(spec.monitor.rate(1, True), 250.0)
    assert [spec.speculate_at(1, r) for r in range(PROBE_EVERY)] == (
        [False] * (PROBE_EVERY - PROBE_LEN) + [True] * PROBE_LEN)  # off, probed in bursts
    spec.off, spec.switch.round = True, 0
    assert spec.may_launch_ahead(1)
    spec.switch.round = PROBE_EVERY - PROBE_LEN  # the next round probes: no launch-ahead
    assert not spec.may_launch_ahead(1)
    # plain steps measured slower than speculation (host work: 1 token per 5 ms = 200 tok/s;
    # the first after speculative steps is not counted): speculation is back on
    for _ in range(2):
        spec.record_step((1, False), 1, 0.005)
    assert spec.monitor.rate(1, False) is None
    spec.record_step((1, False), 1, 0.005)
    assert math.isclose(spec.monitor.rate(1, False), 200.0)
    # on, but for the probe rounds: now they decode plainly, to measure plain decoding again
    assert [spec.speculate_at(1, r) for r in range(PROBE_EVERY)] == (
        [True] * (PROBE_EVERY - PROBE_LEN) + [False] * PROBE_LEN)
    # batch 8 has no measurement: the cost model decides (on)
    assert spec.speculate_at(8, 0)


def _off_at_batch_1(switch_extra_s: float = 0.0, batches=(1,)):
    """A SpecDecoder with speculation measured slower (250 tok/s per sequence) than plain
    decoding (500: 2 ms a token) at each of `batches`, and a driver that runs rounds as the
    engine would (cycling through the batches), each probe's first speculative round costing
    `switch_extra_s` more than its rate says (a draft model's catch-up); the driver returns
    the rounds where each batch's probes started."""
    from llmaccel.spec.decoder import SpecDecoder
    from llmaccel.spec.costs import StepCosts

    spec = SpecDecoder(SpeculativeConfig(), 2048, None)
    spec.costs = StepCosts({b: 2.0 for b in batches})
    for b in batches:
        spec.record_step(None, 0, 0.0)
        for _ in range(3):
            spec.record_step((b, True), 10 * b, 0.04)
        for _ in range(3):
            spec.record_step((b, False), b, 0.002)
    last = {b: False for b in batches}

    def run(rounds: int) -> dict[int, list[int]]:
        starts = {b: [] for b in batches}
        for r in range(rounds):
            b = batches[r % len(batches)]
            on = spec.speculate_at(b)
            spec.skip_round(b)  # as the engine counts every round, probe or not
            first = on and not last[b]
            if first:
                starts[b].append(r)
            spec.record_step((b, on), (10 if on else 1) * b,
                             (0.04 + (switch_extra_s if first else 0.0)) if on else 0.002)
            last[b] = on
        return starts

    return spec, run


def test_probe_waits_follow_what_switching_costs():
    """A probe that leaves the choice as it was places the next one where its switches'
    measured excess (a draft model's catch-up) is PROBE_COST_SHARE of the plain rounds in
    between, within PROBE_EVERY .. PROBE_EVERY_MAX rounds: cheap switches probe often (the
    choice follows acceptance that changes within a request), dear ones rarely."""
    from llmaccel.spec.switch import PROBE_COST_SHARE, PROBE_EVERY, PROBE_EVERY_MAX, PROBE_LEN

    def gaps(extra_s: float) -> list[int]:
        starts = _off_at_batch_1(extra_s)[1](9000)[1]
        assert starts[0] == PROBE_EVERY - PROBE_LEN
        return [b - a for a, b in zip(starts, starts[1:])]

    assert set(gaps(0.0)) == {PROBE_EVERY}  # free switches: the shortest wait
    # 0.2 s of catch-up per probe at 2 ms per plain round: 5,000 rounds for a 2% share
    assert 0.2 / (PROBE_COST_SHARE * 0.002) > PROBE_EVERY_MAX
    assert set(gaps(0.2)) == {PROBE_EVERY_MAX}
    assert set(gaps(0.004)) == {100}  # 4 ms: 100 rounds


def test_a_change_of_choice_brings_the_next_probe_close():
    """Once plain decoding measures slower than speculation, speculation is chosen; the
    change resets the wait, and the next probe, within PROBE_EVERY rounds, runs plain rounds
    (speculation is measured now)."""
    from llmaccel.spec.switch import PROBE_EVERY, PROBE_EVERY_MAX, PROBE_LEN

    spec, run = _off_at_batch_1(0.2)
    run(1500)
    assert spec.switch._probes[1].every == PROBE_EVERY_MAX
    spec.record_step(None, 0, 0.0)
    # plain slows down to 1 token per 50 ms, 20 tok/s: speculation (250) is faster by more
    # than its on margin, which its dear switches (0.2 s each) widen to ~3.6x
    for _ in range(30):
        spec.record_step((1, False), 1, 0.05)
    assert spec.speculate_at(1)
    spec.skip_round(1)
    assert spec.switch._probes[1].every == PROBE_EVERY
    plain = [r for r in range(PROBE_EVERY) if not spec.speculate_at(1, spec.switch.round + r)]
    assert len(plain) == PROBE_LEN and plain == list(range(plain[0], plain[0] + PROBE_LEN))


def test_probe_schedules_are_per_batch_size():
    """Each batch-size bucket keeps its own probe schedule and switching cost: rounds at
    batch 1, whose switches are free, neither reset nor shorten the long wait of batch 64,
    whose switches are dear (with one global schedule, a batch of 64 on an H100 was probed
    every 32 rounds)."""
    from llmaccel.spec.switch import PROBE_EVERY, PROBE_EVERY_MAX

    spec, run = _off_at_batch_1(0.0, batches=(1, 64))
    spec.switch._probe(64).cost = 1.0  # as if batch 64's first probe had switched at a dear price
    starts = run(6000)
    g1 = [b - a for a, b in zip(starts[1], starts[1][1:])]
    g64 = [b - a for a, b in zip(starts[64], starts[64][1:])]
    # waits count the rounds of all batches (within a round: each runs every other one)
    assert set(g1) <= {PROBE_EVERY - 1, PROBE_EVERY, PROBE_EVERY + 1}, g1
    assert abs(g64[0] - PROBE_EVERY_MAX) <= 2, g64


def test_unsteady_plain_steps_and_cut_short_rounds_are_not_measured():
    """Plain steps launched without async scheduling where it could have run (after a
    change of the running set, or after speculating) are slower than plain decoding runs
    steadily; rounds whose drafts max_tokens cut short emit fewer tokens than speculation
    does. Neither stands for its mode's rate."""
    from llmaccel.engine.sampling_params import SamplingParams
    from llmaccel.engine.scheduler import SchedulerOutput
    from llmaccel.engine.sequence import Sequence
    from llmaccel.spec.decoder import SpecDecoder
    from llmaccel.spec.costs import StepCosts

    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), 2048, None)
    spec.costs = StepCosts({1: 2.0})
    for steady in (True, True, True, False, False):  # the first is not counted
        spec.record_step((1, False), 1, 0.002 if steady else 0.004, steady)
    assert math.isclose(spec.monitor.rate(1, False), 500.0)
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(max_tokens=10))
    seq.output_token_ids = [5] * 7  # two tokens of room: at most 2 drafts
    assert spec._k(seq, lambda k: 1.0) == 2 and spec._capped
    seq.spec_token_ids = [6, 7]
    sched = SchedulerOutput(scheduled=[(seq, 3)])
    assert spec.step_kind(sched) is None  # not measured
    spec._capped = False
    assert spec.step_kind(sched) == (1, True, 3)  # batch, speculative, rows


def test_measured_choice_has_hysteresis():
    """Speculation goes off as soon as plain decoding measures faster, and comes on only
    where it is more than HYSTERESIS faster (no switch cost measured here)."""
    from llmaccel.spec.decoder import SpecDecoder
    from llmaccel.spec.switch import HYSTERESIS
    from llmaccel.spec.costs import StepCosts

    spec = SpecDecoder(SpeculativeConfig(), 2048, None)
    spec.costs = StepCosts({1: 1.0})
    for _ in range(3):
        spec.record_step((1, True), 1, 1 / 1000)  # 1000 tok/s speculating
    plain = 1000 * (1 - HYSTERESIS / 2)  # speculation measured a little faster
    for _ in range(3):
        spec.record_step((1, False), 1, 1 / plain)
    assert spec.speculate_at(1, 0)  # no mode yet: the faster one
    spec.switch._mode[1] = True
    assert spec.speculate_at(1, 0)  # on, and not slower: stays on
    spec.switch._mode[1] = False
    assert not spec.speculate_at(1, 0)  # off: not faster by the margin
    for _ in range(30):
        spec.record_step((1, False), 1, 1 / (1000 * (1 + HYSTERESIS / 2)))
    spec.switch._mode[1] = True
    assert not spec.speculate_at(1, 0)  # on, and plain is faster: off at once
    spec.switch._mode[1] = False
    for _ in range(30):
        spec.record_step((1, False), 1, 1 / (1000 * (1 - 2 * HYSTERESIS)))
    assert spec.speculate_at(1, 0)  # off, but plain is now clearly slower
