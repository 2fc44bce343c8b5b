"""The automatic off switch: per batch size, speculate only where it was measured faster.

Used when the engine measured its step costs (CUDA graphs, spec/costs.py) and `auto_disable`
is on, for batch sizes below `disable_by_batch_size` (at or above it rounds are plain and
nothing is measured). Each batch-size bucket keeps its own measured rates (output
tokens per second per sequence, with and without speculation: `ThroughputMonitor`), its own
choice, and its own probe schedule:

- Before speculation is measured at a bucket, the cost model decides (`prior`: the step costs
  and the engine's recent acceptance, spec/adaptive.best_k).
- Then the measured rates decide, with HYSTERESIS: a bucket changes mode only when the other
  is clearly faster (switching costs a draft model a catch-up, a plain step its launch ahead).
- Probes: every so many rounds at a bucket, PROBE_LEN rounds run the mode not chosen there, to
  measure it again (the first is not measured: a draft model catching up on the tokens it
  skipped; a plain step launched without async scheduling). Without plain probes, a low plain
  rate measured once stood while speculation stayed on: at batch 16 and 64 on an H100 a 0.5B
  draft stayed on at 0.64-0.84x plain. Schedules are per bucket:
  with one global schedule, rounds at another batch size reset the wait, and a batch of 64 on
  an H100 probed every 32 rounds at ~2.7x a plain step's time per round
  (0.85x plain).
- How long a bucket waits between probes follows what its probes cost: the first round after
  each switch is timed against the new mode's steady rate (a draft model's catch-up: ~28 ms at
  batch 64 for a 0.5B draft on an H100, against a 2.3 ms plain step). The wait is the number of plain rounds for which those switches cost
  PROBE_COST_SHARE of the time, within PROBE_EVERY .. PROBE_EVERY_MAX; a change of choice
  brings the next probe within PROBE_EVERY rounds. An earlier rule doubled the wait after
  every probe that confirmed the choice: once a stretch of low acceptance had turned n-gram
  lookup off at batch 4, it stayed off for most later rounds (0.92x).

A draft model or head has no such prediction, and turning off is dear for it: it stays off
until a probe, whose two measured rounds must show it faster by the on margin. Its measured
rate is noisy (a round emits 1 to k + 1 tokens; over the ~10 rounds the monitor weighs, the
rate at batch 1 varies by ~10%), so "off as soon as slower" read noise as a loss: a head whose
speculative rounds ran at 1.17x plain decoding on code was on for 116 rounds and off for 325,
and a simulation of such rounds (OFF_CONFIDENCE) had it on for
44% of them. Without a prediction, speculation goes off when the measured rate is below plain
by more than OFF_CONFIDENCE standard errors (ThroughputMonitor.rate_se).

n-gram lookup needs no probes while off (`ShadowAcceptance`): its drafts are a function of
the tokens alone, so what it would have drafted at a past position, checked against the tokens
plain decoding produced there, is exactly what a verify step would have accepted. The switch
predicts a speculative round's rate from that acceptance and the round's time: the graph
replay time of its rows (spec/costs.StepCosts) plus the host and launch time measured on the
bucket's speculative rounds (`overhead`). Probes had measured acceptance on two rounds, and
acceptance changes within a request (a code rewrite copies the code, then explains it): at
batch 64 on an H100, where the two rates were within ~15%, probes every 32 rounds flipped the
choice ~130 times in 3 runs, at 0.85-0.90x plain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from llmaccel.spec.costs import StepCosts, ThroughputMonitor, batch_bucket

PROBE_EVERY = 32
# (4096: a draft model's probe at batch 64 on an H100 ran speculative rounds of ~23 ms against
# 2.3 ms plain steps, its catch-up included; at a cap of 512 rounds
# those probes were several percent of the time, not PROBE_COST_SHARE.)
PROBE_EVERY_MAX = 4096
PROBE_LEN = 3
PROBE_COST_SHARE = 0.02
# Speculation comes on only where it is this much faster (plus its switching cost:
# SpecSwitch._margin_on), and goes off as soon as it is slower: never slower than plain
# decoding. (A symmetric 5% band had speculation stay on at up to 5% below
# plain: draft prose, batch 4, 0.84x.)
HYSTERESIS = 0.05
# Speculative rounds measured after a switch to speculation before the measured rate (not
# the prediction that switched it on) may switch it off again: the monitor's speculative
# rate is stale until then (it was measured before the last switch off).
FRESH_ROUNDS = 2
# After the measured rate switched speculation off, the prediction may not switch it back on
# for this many rounds at the bucket: the prediction and the measurement disagreed, and
# shadow samples taken meanwhile show the acceptance after that stretch.
HOLD_ROUNDS = 32
# Without a shadow prediction, speculation goes off only where its measured rate is below
# plain decoding's by more than this many standard errors. Simulated batch-1 rounds (k = 4,
# per-draft acceptance 0.65/0.5/0.45/0.42, a round 1.85 plain steps long: 1.18x plain if
# always on; 3,000 rounds, 5 seeds) were on for 68-76% of the rounds instead of 40-48%, at
# 1.13-1.16x instead of 1.08-1.11x; at acceptance 0.45/0.4/0.35/0.3 (0.92x if always on)
# 0.967-0.984x instead of 0.973-0.987x; at 0.1 (0.60x) 0.933-0.940x against 0.934-0.938x
# (tests/spec/test_spec_switch_noise.py runs such rounds).
OFF_CONFIDENCE = 1.0
# Shadow samples the prediction needs (at batch 64, 8 arrive per step: INDEX_SPREAD).
MIN_SHADOW_SAMPLES = 8


class StepKind(NamedTuple):
    """A decode step to measure: its batch, whether it speculated, and its rows (the batch
    plus every draft it verified)."""
    batch: int
    speculative: bool
    rows: int = 0


@dataclass
class _Probe:
    """When a batch-size bucket next runs the mode not chosen there, to measure it again."""
    start: int  # the round where its next probe starts
    every: int = PROBE_EVERY  # rounds from one probe to the next
    mode: bool | None = None  # the choice when the current probe began (None: not begun)
    cost: float = 0.0  # seconds the mode switches here cost beyond steady rounds, this probe


@dataclass
class _Mean:
    """An exponentially decayed mean."""
    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float, decay: float) -> None:
        self.total = decay * self.total + value
        self.weight = decay * self.weight + 1.0

    @property
    def value(self) -> float:
        return self.total / self.weight


class ShadowAcceptance:
    """What n-gram lookup would have accepted while speculation was off: samples of (drafts,
    accepted) at past positions of the running sequences (SpecDecoder.index_running takes
    them), as decayed means of the tokens a verify round emits per sequence (accepted + 1)
    and the rows it computes (drafts + 1). The window grows with the batch (more samples
    arrive per step): about 16 + 2 B samples, a few dozen steps at any batch size."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the samples (speculation ran: its measured rounds say more)."""
        self._tokens, self._rows = _Mean(), _Mean()
        self.samples = 0

    def observe(self, drafted: int, accepted: int, batch: int) -> None:
        decay = 1.0 - 1.0 / (16 + 2 * batch)
        self._tokens.add(accepted + 1, decay)
        self._rows.add(drafted + 1, decay)
        self.samples += 1

    def estimate(self) -> tuple[float, float] | None:
        """(tokens per round, rows per sequence) per sequence, or None before enough samples."""
        if self.samples < MIN_SHADOW_SAMPLES:
            return None
        return self._tokens.value, self._rows.value


class SpecSwitch:
    """Per batch-size bucket: speculate or not this round (`decide`), fed each decode step's
    measurement (`record_step`). `prior(batch)`: the cost model's answer before speculation
    is measured at a bucket. `shadow`: n-gram lookup's acceptance while off (None for a draft
    model, whose acceptance is measured by probes)."""

    def __init__(self, costs: StepCosts, prior: Callable[[int], bool],
                 shadow: ShadowAcceptance | None = None) -> None:
        self.costs = costs
        self.prior = prior
        self.shadow = shadow
        self.monitor = ThroughputMonitor()
        self.round = 0  # decode rounds seen
        self._probes: dict[int, _Probe] = {}  # bucket -> its probe schedule
        self._mode: dict[int, bool] = {}  # bucket -> the last measured choice
        self._last_mode: bool | None = None  # whether the last measured step speculated
        self._overhead: dict[int, _Mean] = {}  # bucket -> spec round s beyond its graph time
        self._fresh: dict[int, int] = {}  # bucket -> measured spec rounds since switched on
        self._hold: dict[int, int] = {}  # bucket -> first round a prediction may switch on
        self._switch_cost: dict[int, _Mean] = {}  # bucket -> s a switch costs, beyond steady
        self.num_switches = 0  # changes of a bucket's measured choice (benchmarks read it)

    # -- the choice ----------------------------------------------------------------------------
    def decide(self, batch: int, round_index: int | None = None) -> tuple[bool, bool]:
        """(speculate, chosen) for a round (default: the next one): the chosen mode, or the
        other one in a probe's rounds -- plain rounds only once speculation's choice is a
        measured one (before that, speculative rounds are about to measure it), speculative
        ones only where no prediction stands in for them."""
        round_index = self.round if round_index is None else round_index
        chosen = self._chosen(batch)
        if self._probing(batch, round_index):
            if chosen and self.monitor.rate(batch, True) is not None:
                return False, chosen
            if not chosen and self.predicted_rate(batch) is None:
                return True, chosen
        return chosen, chosen

    def _chosen(self, batch: int) -> bool:
        """The mode of this batch size's bucket: before speculation is measured there, what
        measured buckets imply (`_unmeasured`); then the measured rates, where speculation
        stays on only while it measures at least as fast as plain decoding (never slower;
        without a shadow prediction, within the noise of its measurement:
        `_off_slack`), and comes on only when it is faster by the bucket's on margin
        (`_margin_on`). While off, n-gram lookup's prediction stands in for a measurement."""
        measured = self.monitor.rate(batch, True)  # tokens/s per sequence while speculating
        if measured is None:
            return self._unmeasured(batch)
        bucket = batch_bucket(batch)
        mode = self._mode.get(bucket)
        plain = self._plain_rate(batch)
        if mode is None:
            return measured >= plain
        if mode:
            if self._fresh.get(bucket, FRESH_ROUNDS) < FRESH_ROUNDS:
                return True  # switched on by a prediction: not measured since
            return measured + self._off_slack(batch) >= plain
        predicted = self.predicted_rate(batch)
        if predicted is not None:
            if self.round < self._hold.get(bucket, 0):
                return False
            measured = predicted
        return measured >= plain * (1.0 + self._margin_on(batch))

    def _off_slack(self, batch: int) -> float:
        """How far below plain decoding the measured speculative rate may be before
        speculation goes off: none with a shadow prediction (it comes back on as soon as
        the prediction says so), else OFF_CONFIDENCE standard errors of the rate."""
        if self.shadow is not None:
            return 0.0
        return OFF_CONFIDENCE * (self.monitor.rate_se(batch, True) or 0.0)

    def _unmeasured(self, batch: int) -> bool:
        """A bucket without speculative measurements follows the measured crossover: off if a
        smaller batch size was measured off, on if a larger one was measured on (speculation
        pays less as the batch grows); else the cost model (`prior`). Buckets seen only in
        the rounds between prefills (a batch of 64 admitted in two chunks runs rounds at 32)
        are never measured (those rounds are not all decoding), and the cost model, which
        leaves out a draft model's catch-up, had them speculate at a loss."""
        bucket = batch_bucket(batch)
        for other, on in self._mode.items():
            if other < bucket and not on:
                return False
            if other > bucket and on:
                return True
        return self.prior(batch)

    def _margin_on(self, batch: int) -> float:
        """How much faster speculation must measure to come on: HYSTERESIS, plus what the
        bucket's switches cost (a switch on and one back) spread over PROBE_EVERY plain
        rounds. A draft model's catch-up makes its margin wide, n-gram lookup's narrow."""
        cost = self._switch_cost.get(batch_bucket(batch))
        if cost is None:
            return HYSTERESIS
        round_s = 1.0 / self._plain_rate(batch)
        return HYSTERESIS + 2.0 * cost.value / (PROBE_EVERY * round_s)

    def _plain_rate(self, batch: int) -> float:
        """Plain decoding's tokens/s per sequence at this batch size: measured or, before
        that, at its best, from its graph's replay time (host work only slows it). Losing to
        the latter turns speculation off, and the plain steps then run are measured."""
        return self.monitor.rate(batch, False) or 1000.0 / self.costs.step_ms(batch)

    def overhead_ms(self, batch: int) -> float | None:
        """Measured time of this bucket's speculative rounds beyond their graph replay."""
        mean = self._overhead.get(batch_bucket(batch))
        return None if mean is None else 1000.0 * mean.value

    def predicted_rate(self, batch: int) -> float | None:
        """A speculative round's tokens/s per sequence at this batch size from n-gram
        lookup's shadow acceptance: tokens per round over the graph time of its rows plus the
        overhead measured on this bucket's speculative rounds; None without both."""
        if self.shadow is None:
            return None
        estimate = self.shadow.estimate()
        overhead = self._overhead.get(batch_bucket(batch))
        if estimate is None or overhead is None:
            return None
        tokens, rows = estimate
        seconds = self.costs.step_ms(round(batch * rows)) / 1000.0 + max(0.0, overhead.value)
        return tokens / seconds

    # -- probes --------------------------------------------------------------------------------
    def _probe(self, batch: int) -> _Probe:
        bucket = batch_bucket(batch)
        probe = self._probes.get(bucket)
        if probe is None:
            probe = self._probes[bucket] = _Probe(self.round + PROBE_EVERY - PROBE_LEN)
        return probe

    def _probing(self, batch: int, round_index: int) -> bool:
        start = self._probe(batch).start
        return start <= round_index < start + PROBE_LEN

    def next_round(self, batch: int, chosen: bool) -> None:
        """Count a round and book its choice where it is a measured one (the mode the
        hysteresis holds to); once a probe's rounds at this batch size are over (or passed
        while the batch was elsewhere), place its next probe: PROBE_EVERY rounds on if the
        choice changed since the probe began, else as far as its switches' cost allows
        (PROBE_COST_SHARE)."""
        self.round += 1
        probe = self._probe(batch)
        bucket = batch_bucket(batch)
        if self.monitor.rate(batch, True) is not None:
            before = self._mode.get(bucket, chosen)
            if before != chosen:
                # the choice changed: the mode left is measured again soon
                probe.every = PROBE_EVERY
                probe.start = min(probe.start, self.round + PROBE_EVERY - PROBE_LEN)
                self.num_switches += 1
                if chosen:
                    self._fresh[bucket] = 0
                else:
                    self._hold[bucket] = self.round + HOLD_ROUNDS
            self._mode[bucket] = chosen
        if self.round >= probe.start + PROBE_LEN:
            if probe.mode is not None and chosen == probe.mode:
                round_s = 1.0 / self._plain_rate(batch)  # a plain round: 1 token/sequence
                wait = probe.cost / (PROBE_COST_SHARE * round_s)
                probe.every = round(min(max(wait, PROBE_EVERY), PROBE_EVERY_MAX))
            # (the switch back after the probe lands in the next probe's cost: one probe's
            # switches either way per wait)
            probe.start, probe.mode, probe.cost = self.round + probe.every - PROBE_LEN, None, 0.0
        elif self.round >= probe.start and probe.mode is None:
            probe.mode = chosen  # the choice the probe runs against

    # -- measurements --------------------------------------------------------------------------
    def record_step(self, kind: StepKind | None, tokens: int, seconds: float,
                    steady: bool = True) -> None:
        """Feed the monitor one decode step, unless it is the first of its kind after the
        other (a draft model catching up on the tokens it skipped; a plain step not yet
        overlapped with the next by async scheduling) or after a step that was not all
        decoding (`kind` None: a prefill, whose requests' first speculative step has the draft
        model prefill their prompts -- measured at 17 ms of a 0.5B draft's time at batch 4 on
        an H100, where a round takes 5 ms), or a plain step that is not `steady`: launched
        without async scheduling where it could have been (after a change of the running set,
        or the round after speculating). Plain decoding's rate is what it does steadily,
        launched ahead: at batch 64 on an H100, those steps took 2.3 ms and the others 3.9,
        and counting the latter made speculation look
        faster there than it was. A measured speculative round also times the overhead
        beyond its rows' graph replay, for the shadow prediction."""
        if kind is None:
            self._last_mode = None
            return
        batch, speculative = kind[0], kind[1]
        if speculative == self._last_mode and (speculative or steady):
            self.monitor.observe(batch, speculative, tokens / batch, seconds)
            if speculative:
                bucket = batch_bucket(batch)
                self._fresh[bucket] = self._fresh.get(bucket, 0) + 1
                rows = kind[2] if len(kind) > 2 and kind[2] else batch
                extra = seconds - self.costs.step_ms(rows) / 1000.0
                self._overhead.setdefault(bucket, _Mean()).add(extra, 0.9)
        elif self._last_mode is not None and speculative != self._last_mode:
            # a switch: what its first round cost beyond the new mode's steady rate is the
            # price of switching, which sets how often probes may switch (PROBE_COST_SHARE)
            rate = self.monitor.rate(batch, speculative)
            if rate:
                extra = max(0.0, seconds - tokens / batch / rate)
                self._probe(batch).cost += extra
                self._switch_cost.setdefault(batch_bucket(batch), _Mean()).add(extra, 0.7)
        self._last_mode = speculative
