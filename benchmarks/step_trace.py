"""Where a generate call's wall time goes, step by step: a wrapper around `LLMEngine.step`
that times each call and classifies the step it completed, from the engine's counters (no
profiler, no device sync: the step's own sync is the one that ends it).

Classes (the step a call completes, which async scheduling may have launched a call earlier):
- `prefill`: the step ran prompt tokens (a prefill or a mixed prefill + decode step);
- `spec`: a decode step that verified drafts for at least one sequence;
- `plain-ahead`: a plain decode step launched ahead by the previous call (async scheduling);
- `plain`: a plain decode step launched in this call (after a change of the running set, a
  speculative round, or a probe's decision);
- `idle`: the call completed no step (only outputs).

Per class: calls, seconds, emitted tokens, and rows run through the model; the off switch's
cost is then visible as, e.g., `plain` steps that would have been `plain-ahead` in a plain
engine, or `spec` seconds per token above plain's.
"""

from __future__ import annotations

import time
from collections import defaultdict


class StepTrace:
    """Use as `with StepTrace(llm.engine) as trace: llm.generate(...)`; then `trace.summary()`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
        self.wall = 0.0

    def __enter__(self) -> StepTrace:
        engine = self.engine
        original = engine.step

        def step():
            stats = engine.stats
            spec = engine.spec.stats if engine.spec is not None else None
            ahead = engine._ahead is not None
            steps0, gen0 = stats.num_steps, stats.num_generated_tokens
            rows0 = stats.num_batched_tokens
            verified0 = spec.num_steps if spec is not None else 0
            running = len(engine.scheduler.running)
            t0 = time.perf_counter()
            out = original()
            dt = time.perf_counter() - t0
            rows = stats.num_batched_tokens - rows0
            if stats.num_steps == steps0:
                kind = "idle"
            elif spec is not None and spec.num_steps > verified0:
                kind = "spec"
            elif ahead:
                kind = "plain-ahead"
            elif rows > running:
                kind = "prefill"
            else:
                kind = "plain"
            t = self.totals[kind]
            t[0] += 1
            t[1] += dt
            t[2] += stats.num_generated_tokens - gen0
            t[3] += rows
            return out

        engine.step = step
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._start
        del self.engine.step  # the instance attribute; the class's method shows again

    def summary(self) -> dict:
        """{class: {"calls", "ms", "tokens", "rows"}} plus the wall outside steps."""
        out = {k: {"calls": int(c), "ms": round(s * 1e3, 2), "tokens": int(t), "rows": int(r)}
               for k, (c, s, t, r) in sorted(self.totals.items())}
        in_steps = sum(v[1] for v in self.totals.values())
        out["outside_steps_ms"] = round((self.wall - in_steps) * 1e3, 2)
        return out


def brief(summary: dict) -> str:
    """One line: per class calls / ms / ms per emitted token."""
    parts = []
    for k, v in summary.items():
        if k == "outside_steps_ms":
            continue
        per = f"{v['ms'] / v['tokens']:.3f}" if v["tokens"] else "-"
        parts.append(f"{k} {v['calls']}/{v['ms']:.0f}ms/{per}")
    return ", ".join(parts) + f", outside {summary['outside_steps_ms']:.0f}ms"
