"""Request-level serving metrics with `vllm bench serve`'s definitions, from per-request
timelines (what any backend's client records: send time, first-token time, chunk arrivals).

- TTFT: first output chunk - send time, per successful request.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), per request with more than one token.
- ITL: every gap between two successive output chunks, pooled over requests (a chunk may
  carry several tokens: speculative decoding, or a server that batches its stream).
- E2EL: last chunk - send time.
- Throughputs divide by the benchmark's duration (first send to last finish); input tokens
  are counted for completed requests only, as vLLM does.
- Goodput: completed requests meeting every given SLO (ms), per second.

Failed requests are counted (`failed`), never dropped silently, and never enter latencies.
With no completed request the latency statistics are None (JSON null), not 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds on one monotonic clock."""
    success: bool
    prompt_len: int
    output_len: int = 0
    start: float = 0.0                    # when the request was sent
    ttft: float | None = None             # seconds from send to the first output chunk
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks
    latency: float | None = None          # seconds from send to the last chunk (E2E)
    error: str = ""
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def as_row(self) -> dict[str, Any]:
        """A `.requests.jsonl` row (milliseconds), without the generated text."""
        ms = (lambda s: None if s is None else round(s * 1e3, 4))
        return {"success": self.success, "prompt_len": self.prompt_len,
                "output_len": self.output_len, "ttft_ms": ms(self.ttft),
                "tpot_ms": ms(self.tpot), "e2e_ms": ms(self.latency),
                "itl_ms": [round(x * 1e3, 4) for x in self.itl], "error": self.error}


@dataclass(frozen=True)
class LatencyStats:
    mean: float | None
    median: float | None
    std: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        """Statistics in milliseconds; percentiles interpolate linearly (numpy's default, as
        vLLM uses)."""
        if len(seconds) == 0:
            return cls(None, None, None, None, None)
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p95, p99 = np.percentile(ms, [95, 99])
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()), float(p95),
                   float(p99))


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float          # completed requests / s
    output_throughput: float           # output tokens / s
    total_token_throughput: float      # (input + output tokens) / s
    request_goodput: float | None      # requests meeting every SLO / s; None without SLOs
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    slos_ms: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def vllm_dict(self) -> dict[str, Any]:
        """The keys `vllm bench serve --save-result` writes (mean_ttft_ms, p99_itl_ms, ...), so
        results from both tools sit side by side."""
        out: dict[str, Any] = {
            "duration": self.duration_s, "completed": self.completed, "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput}
        for name in LATENCIES:
            s: LatencyStats = getattr(self, name)
            out[f"mean_{name}_ms"] = s.mean
            out[f"median_{name}_ms"] = s.median
            out[f"std_{name}_ms"] = s.std
            out[f"p95_{name}_ms"] = s.p95
            out[f"p99_{name}_ms"] = s.p99
        return out

    def record_metrics(self) -> dict[str, float]:
        """Metric name -> value in docs/workloads.md's record names (ttft_ms_p50, out_tok_s, ...);
        statistics that do not exist (no completed request) are left out."""
        out: dict[str, float] = {
            "completed": self.completed, "failed": self.failed,
            "request_throughput": self.request_throughput, "out_tok_s": self.output_throughput,
            "total_tok_s": self.total_token_throughput}
        if self.request_goodput is not None:
            out["goodput"] = self.request_goodput
        names = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}
        for name, prefix in names.items():
            s: LatencyStats = getattr(self, name)
            for suffix, value in (("mean", s.mean), ("p50", s.median), ("p95", s.p95),
                                  ("p99", s.p99)):
                if value is not None:
                    out[f"{prefix}_{suffix}"] = value
        return out


def check_slos(slos_ms: dict[str, float] | None) -> dict[str, float]:
    """`{"ttft": 200, "tpot": 50, "e2el": 5000}` (ms, any subset); bad keys or values raise."""
    slos = dict(slos_ms or {})
    for key, value in slos.items():
        if key not in SLO_KEYS:
            raise ValueError(f"unknown SLO {key!r}: use {', '.join(SLO_KEYS)} (milliseconds)")
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"SLO {key} must be a positive number of ms, got {value!r}")
    return slos


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A completed request meets the SLOs if each given bound holds; a request of one token
    has no TPOT, which therefore cannot violate a TPOT bound."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for key, bound in slos_ms.items():
        v = values[key]
        if key == "tpot" and v is None:
            continue
        if v is None or v * 1e3 > bound:
            return False
    return True


def calculate_metrics(results: Iterable[RequestResult], duration_s: float,
                      slos_ms: dict[str, float] | None = None) -> BenchmarkMetrics:
    results = list(results)
    if duration_s <= 0 and results:
        raise ValueError(f"duration must be positive, got {duration_s}")
    slos = check_slos(slos_ms)
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    per_s = (lambda x: x / duration_s if duration_s > 0 else 0.0)
    goodput = per_s(sum(meets_slos(r, slos) for r in done)) if slos else None
    return BenchmarkMetrics(
        completed=len(done), failed=len(results) - len(done), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=per_s(len(done)), output_throughput=per_s(total_out),
        total_token_throughput=per_s(total_in + total_out), request_goodput=goodput,
        ttft=LatencyStats.of([r.ttft for r in done if r.ttft is not None]),
        tpot=LatencyStats.of([t for r in done if (t := r.tpot) is not None]),
        itl=LatencyStats.of([x for r in done for x in r.itl]),
        e2el=LatencyStats.of([r.latency for r in done if r.latency is not None]),
        slos_ms=slos)


def usd_per_million_output_tokens(usd_per_gpu_hour: float, num_gpus: int, duration_s: float,
                                  output_tokens: int) -> float | None:
    """What the run's output cost at a rental price: GPU-hours used / million tokens made."""
    if output_tokens <= 0 or duration_s <= 0:
        return None
    return usd_per_gpu_hour * num_gpus * (duration_s / 3600.0) / output_tokens * 1e6


__all__ = ["BenchmarkMetrics", "LatencyStats", "RequestResult", "calculate_metrics",
           "check_slos", "meets_slos", "usd_per_million_output_tokens"]
