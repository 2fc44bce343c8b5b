"""The load generator: sends requests to a backend at a request rate (Poisson arrivals, or
gamma with a burstiness factor, as `vllm bench serve` does) and/or with at most N in
flight, and collects every request's result. The clock starts at the first send and stops
when the last request finishes; that span is the benchmark's duration."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from llmaccel.bench.backends.base import Backend, BenchRequest
from llmaccel.bench.metrics import RequestResult


@dataclass(frozen=True)
class LoadPoint:
    """One point of a load sweep: `request_rate` in req/s (inf: all at once) and a cap on
    requests in flight (None: no cap)."""
    request_rate: float = math.inf
    max_concurrency: int | None = None
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")

    @property
    def label(self) -> str:
        parts = []
        if math.isfinite(self.request_rate):
            parts.append(f"rate={self.request_rate:g}")
        if self.max_concurrency is not None:
            parts.append(f"concurrency={self.max_concurrency}")
        return ",".join(parts) or "all-at-once"

    def config(self) -> dict:
        return {"request_rate": self.request_rate if math.isfinite(self.request_rate)
                else "inf", "max_concurrency": self.max_concurrency,
                "burstiness": self.burstiness}


def arrival_gaps(n: int, point: LoadPoint, seed: int = 0) -> list[float]:
    """Seconds to wait before each of n requests: 0 for an infinite rate, else gamma draws
    with mean 1 / rate (exponential, i.e. Poisson arrivals, when burstiness is 1)."""
    if not math.isfinite(point.request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (point.request_rate * point.burstiness)
    return [rng.gammavariate(point.burstiness, theta) for _ in range(n)]


async def run_load(backend: Backend, requests: Sequence[BenchRequest], point: LoadPoint,
                   seed: int = 0, description: str = "requests",
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Results in request order, and the duration in seconds."""
    limits = [c for c in (point.max_concurrency, backend.max_concurrency) if c is not None]
    semaphore = asyncio.Semaphore(min(limits)) if limits else None
    bar = task = None
    if progress:
        from llmaccel.progress import progress_bar

        bar = progress_bar()
        bar.start()
        task = bar.add_task(f"{backend.name} {description}", total=len(requests))

    async def one(request: BenchRequest) -> RequestResult:
        if semaphore is None:
            result = await backend.generate(request)
        else:
            async with semaphore:
                result = await backend.generate(request)
        if bar is not None:
            bar.update(task, advance=1)
        return result

    tasks = []
    start = time.perf_counter()
    try:
        for request, gap in zip(requests, arrival_gaps(len(requests), point, seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
    finally:
        if bar is not None:
            bar.stop()
    finish = max((r.start + r.latency for r in results if r.latency is not None),
                 default=time.perf_counter())
    return list(results), max(finish, time.perf_counter()) - start
