"""The off switch under noisy speculative rounds (spec/switch.py OFF_CONFIDENCE): a draft
model or head emits 1 to k + 1 tokens a round, so its measured rate is noisy. Rounds drawn
from a fixed acceptance, driven through SpecSwitch as the engine drives it: speculation that
pays stays on for most rounds; speculation that does not stays off for most rounds. And the
monitor's standard error against a direct computation."""

from __future__ import annotations

import math
import random

import pytest

from llmaccel.spec.costs import StepCosts, ThroughputMonitor
from llmaccel.spec.switch import SpecSwitch, StepKind

K = 4
SPEC_MS, PLAIN_MS = 3.39, 1.83  # a head round and a plain step on an H100


def _tokens(rng: random.Random, accept: list[float]) -> int:
    n = 1
    for p in accept:
        if rng.random() >= p:
            break
        n += 1
    return n


def _run(accept: list[float], rounds: int = 3000, seed: int = 0) -> tuple[float, float]:
    """(share of rounds speculating, throughput over plain decoding's) of a batch-1 run."""
    rng = random.Random(seed)
    switch = SpecSwitch(StepCosts({1: 1.75, 8: 1.9}), prior=lambda b: True, shadow=None)
    on = tokens = 0
    seconds = 0.0
    for _ in range(rounds):
        spec, chosen = switch.decide(1)
        n = _tokens(rng, accept) if spec else 1
        s = (SPEC_MS if spec else PLAIN_MS) * (1 + 0.03 * rng.gauss(0, 1)) / 1000
        switch.record_step(StepKind(1, spec, 1 + K if spec else 1), n, s)
        switch.next_round(1, chosen)
        on, tokens, seconds = on + spec, tokens + n, seconds + s
    return on / rounds, tokens / seconds * PLAIN_MS / 1000


def _always_on(accept: list[float]) -> float:
    return (1 + sum(math.prod(accept[:j + 1]) for j in range(K))) / SPEC_MS * PLAIN_MS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculation_that_pays_stays_on_through_noisy_rounds(seed, monkeypatch):
    accept = [0.65, 0.5, 0.45, 0.42]
    assert _always_on(accept) == pytest.approx(1.178, abs=0.002)
    on, speedup = _run(accept, seed=seed)
    assert on > 0.6 and speedup > 1.12, (on, speedup)
    # off as soon as the ~10-round rate dips below plain: on for ~40-48% of the rounds,
    # ~1.08-1.11x
    monkeypatch.setattr("llmaccel.spec.switch.OFF_CONFIDENCE", 0.0)
    on_before, speedup_before = _run(accept, seed=seed)
    assert on_before < on - 0.15 and speedup_before < speedup, (on_before, speedup_before)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculation_that_does_not_pay_stays_mostly_off(seed):
    for accept, least in (([0.45, 0.4, 0.35, 0.3], 0.95), ([0.1] * K, 0.92)):
        assert _always_on(accept) < 0.93
        on, speedup = _run(accept, seed=seed)
        assert on < 0.3 and speedup > least, (accept, on, speedup)


def test_rate_standard_error_is_the_delta_method_over_decayed_rounds():
    m = ThroughputMonitor(decay=0.8)
    assert m.rate_se(1, True) is None
    rng = random.Random(4)
    # (2-4 tokens a round: none is slow enough for the monitor's outlier clamp)
    rows = [(float(rng.randint(2, 4)), 0.003 + 0.0001 * rng.random()) for _ in range(12)]
    for t, s in rows:
        m.observe(1, True, t, s)
    w = [0.8 ** (len(rows) - 1 - i) for i in range(len(rows))]
    rate = sum(wi * t for wi, (t, _) in zip(w, rows)) / sum(wi * s for wi, (_, s) in zip(w, rows))
    assert m.rate(1, True) == pytest.approx(rate)
    var = sum(wi * (t - rate * s) ** 2 for wi, (t, s) in zip(w, rows)) / sum(w)
    mean_s = sum(wi * s for wi, (_, s) in zip(w, rows)) / sum(w)
    se = math.sqrt(var * sum(x * x for x in w)) / sum(w) / mean_s
    assert m.rate_se(1, True) == pytest.approx(se)
    # steps of the other mode age the sums: the rate stays, its error grows
    for _ in range(5):
        m.observe(1, False, 1.0, 0.002)
    assert m.rate(1, True) == pytest.approx(rate)
    assert m.rate_se(1, True) > se
