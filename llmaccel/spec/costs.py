"""What a speculative step costs, relative to a plain decode step of the same batch.

A step that verifies k drafts for each of B sequences runs B (k + 1) rows through the target
and, with a draft model, k draft steps of B rows first. On a GPU the engine measures both from
its captured CUDA graphs (ModelRunner runs a verify step as decode rows, so a graph of that
many rows is the step): t(R) is the replay time of the graph for R rows, and

    cost(B, k) = [t(B (k + 1)) + k t_draft(B)] / t(B).

At small B, decode streams the weights and t barely grows with R, so verification is nearly
free and only the draft steps cost; at large B the GPU is busy computing and t(B (k + 1)) ~
(k + 1) t(B), where no acceptance rate pays for speculation. `best_k` (spec/adaptive.py) picks
the k with the most tokens per unit of cost; where that is 0 for the batch's acceptance,
speculation is off for the step: the measured crossover, on this GPU, for this model.

Without measurements (CPU, eager) the cost is the constant model 1 + k c.

The step costs leave out the host's work per step and assume i.i.d. acceptance, so once
speculative steps have run at a batch size the decision uses their measured output tokens per
second (`ThroughputMonitor`, per batch-size bucket and sequence) against plain decoding's,
measured the same way once plain steps have run at that batch size, else plain decoding at its
best, 1 / t(B) (host work only slows it: at batch 1 the measured rate can be well below). While
off, SpecDecoder speculates for a couple of rounds now and then to measure again.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class StepCosts:
    """Replay times (ms) per captured row count of the target's graphs and, for a draft
    model, the draft's. `cost` is asked for every drafting sequence and every candidate k
    each step, so its answers are kept per (batch, k)."""

    def __init__(self, target_ms: dict[int, float],
                 draft_ms: dict[int, float] | None = None) -> None:
        self.target_ms = target_ms
        self.draft_ms = draft_ms
        self._target_sizes = sorted(target_ms)
        self._draft_sizes = sorted(draft_ms) if draft_ms else []
        self._costs: dict[tuple[int, int], float] = {}

    @staticmethod
    def _time(times: dict[int, float], sizes: list[int], rows: int) -> float:
        """The time of `rows` rows: the graph that serves them (the smallest captured size
        that holds them); past the largest, proportional to rows (eager steps, compute-bound
        by then)."""
        i = bisect.bisect_left(sizes, rows)
        if i < len(sizes):
            return times[sizes[i]]
        return times[sizes[-1]] * rows / sizes[-1]

    def step_ms(self, rows: int) -> float:
        """A decode step of `rows` rows (a plain step of that many sequences, or a verify
        step: the batch plus its drafts): its graph's replay time."""
        return self._time(self.target_ms, self._target_sizes, max(1, rows))

    def cost(self, batch: int, k: int) -> float:
        """cost(B, k) of the module docstring (1.0 at k = 0)."""
        if k <= 0:
            return 1.0
        cached = self._costs.get((batch, k))
        if cached is None:
            total = self._time(self.target_ms, self._target_sizes, batch * (k + 1))
            if self.draft_ms:
                total += k * self._time(self.draft_ms, self._draft_sizes, batch)
            cached = self._costs[batch, k] = total / self.step_ms(batch)
        return cached

    def cost_fn(self, batch: int) -> Callable[[int], float]:
        return lambda k: self.cost(batch, k)


def constant_cost_fn(cost_ratio: float) -> Callable[[int], float]:
    """The constant model: each draft costs `cost_ratio` of a decode step, verifying is free."""
    return lambda k: 1.0 + k * cost_ratio


def batch_bucket(batch: int) -> int:
    """Batch sizes are compared in power-of-two buckets (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class _Rate:
    """Decayed sums of one mode's steps: tokens and seconds (the rate is their ratio), and
    for its standard error the weights, their squares and the second moments."""
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    weight: float = 0.0
    weight2: float = 0.0
    tokens2: float = 0.0
    tokens_seconds: float = 0.0
    seconds2: float = 0.0

    def age(self, decay: float) -> None:
        self.tokens *= decay
        self.seconds *= decay
        self.weight *= decay
        self.weight2 *= decay * decay
        self.tokens2 *= decay
        self.tokens_seconds *= decay
        self.seconds2 *= decay


class ThroughputMonitor:
    """Measured output tokens per second (per sequence) of decode steps with and without
    speculation, per batch-size bucket: what the step costs above leave out (host work per
    step, the verify and draft bookkeeping, acceptance that is not i.i.d.). Exponentially
    decayed sums, so the rates follow a changing workload."""

    MIN_SAMPLES = 2
    OUTLIER = 3.0

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self._rates: dict[tuple[int, bool], _Rate] = {}

    def observe(self, batch: int, speculative: bool, tokens: float, seconds: float) -> None:
        """One step's tokens (per sequence) and seconds. The other mode's sums at this batch
        size age too (their rate stays, their weight fades): a probe after many rounds in one
        mode then measures the other afresh instead of averaging into stale rounds (with
        speculation off for 30 rounds at batch 1 after a stretch of poor acceptance, the
        probes' rounds had weighed little against it, and backing off kept it off)."""
        bucket = batch_bucket(batch)
        r = self._rates.setdefault((bucket, speculative), _Rate())
        if r.samples >= self.MIN_SAMPLES and r.tokens > 0 and r.seconds > 0:
            # a round far slower than the rate (a host hiccup, a garbage collection) counts
            # as OUTLIER times the rate's time: the rate is a ratio of sums, and one such round
            # among ~10 moved it by tens of percent
            seconds = min(seconds, self.OUTLIER * tokens * r.seconds / r.tokens)
        r.age(self.decay)
        r.tokens += tokens
        r.seconds += seconds
        r.weight += 1.0
        r.weight2 += 1.0
        r.tokens2 += tokens * tokens
        r.tokens_seconds += tokens * seconds
        r.seconds2 += seconds * seconds
        r.samples += 1
        other = self._rates.get((bucket, not speculative))
        if other is not None:
            other.age(self.decay)

    def rate(self, batch: int, speculative: bool) -> float | None:
        """Tokens per second at this batch size, or None before enough steps."""
        r = self._rates.get((batch_bucket(batch), speculative))
        if r is None or r.samples < self.MIN_SAMPLES or r.seconds <= 0:
            return None
        return r.tokens / r.seconds

    def rate_se(self, batch: int, speculative: bool) -> float | None:
        """The standard error of `rate` (tokens/s), or None where there is no rate: the
        rate is a ratio of weighted means, R = t/s; by the delta method its variance is the
        weighted variance of t_i - R s_i, over the effective sample size (sum w)^2 / sum w^2,
        over s^2. Speculative rounds emit 1 to k + 1 tokens each, so over the ~10 rounds
        the decay weighs a rate measured at batch 1 varies by ~10% around its mean."""
        rate = self.rate(batch, speculative)
        if rate is None:
            return None
        r = self._rates[batch_bucket(batch), speculative]
        if r.weight <= 0.0:
            return None
        var = (r.tokens2 - 2.0 * rate * r.tokens_seconds + rate * rate * r.seconds2) / r.weight
        mean_s = r.seconds / r.weight
        return math.sqrt(max(0.0, var) * r.weight2) / r.weight / mean_s


def measure_step_costs(runner, draft=None) -> StepCosts | None:
    """Replay times of the target's captured graphs (and the draft model's), for the cost of
    speculative steps by batch size (spec/costs.py); None without CUDA graphs."""
    if runner.graphs is None:
        return None
    draft_graphs = None if draft is None else draft.runner.graphs
    costs = StepCosts(runner.graphs.time_replays(),
                      None if draft_graphs is None else draft_graphs.time_replays())
    logger.info("speculative step cost relative to a decode step (k = 1 / 4) at batch "
                "1, 4, 16, 64: %s", "; ".join(
                    f"{costs.cost(b, 1):.2f} / {costs.cost(b, 4):.2f}" for b in (1, 4, 16, 64)))
    return costs
