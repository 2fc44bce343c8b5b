"""Serving metrics on hand-made request timelines (answers computed by hand in the comments),
the load generator's arrivals and concurrency cap, and the NVML monitor with a fake NVML."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from llmaccel.bench.backends.base import Backend, BenchRequest
from llmaccel.bench.gpu_monitor import GpuMonitor
from llmaccel.bench.load import LoadPoint, arrival_gaps, run_load
from llmaccel.bench.metrics import (
    RequestResult,
    calculate_metrics,
    check_slos,
    usd_per_million_output_tokens,
)


def _timeline() -> list[RequestResult]:
    # r1: 10 in, 4 out, first chunk at 100 ms, gaps 50/50/100 ms -> E2E 300 ms
    # r2: 20 in, 1 out, first (only) chunk at 200 ms
    # r3: failed
    return [RequestResult(True, 10, 4, 0.0, 0.1, [0.05, 0.05, 0.1], 0.3),
            RequestResult(True, 20, 1, 0.0, 0.2, [], 0.2),
            RequestResult(False, 30, error="HTTP 500")]


def test_metrics_on_a_hand_made_timeline():
    m = calculate_metrics(_timeline(), duration_s=1.0)
    assert (m.completed, m.failed) == (2, 1)
    # input tokens of completed requests only: 10 + 20; output 4 + 1
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 5)
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(35.0)
    # TTFT [100, 200] ms: mean = median = 150; p99 = 100 + 0.99 * 100 = 199
    assert (m.ttft.mean, m.ttft.median, m.ttft.p99) == pytest.approx((150, 150, 199))
    # TPOT only for r1: (300 - 100) / (4 - 1) = 66.67 ms; r2 has one token and no TPOT
    assert m.tpot.mean == pytest.approx(200 / 3) and m.tpot.p99 == pytest.approx(200 / 3)
    # ITL pooled [50, 50, 100]: mean 66.67, median 50, p95 at rank 1.9 -> 50 + 0.9 * 50 = 95
    assert (m.itl.mean, m.itl.median, m.itl.p95) == pytest.approx((200 / 3, 50, 95))
    # E2E [300, 200]: median 250
    assert m.e2el.median == pytest.approx(250)
    assert m.request_goodput is None  # no SLOs given
    rec = m.record_metrics()
    assert rec["out_tok_s"] == pytest.approx(5.0) and rec["ttft_ms_p50"] == pytest.approx(150)
    assert rec["failed"] == 1 and "goodput" not in rec
    v = m.vllm_dict()
    assert v["mean_ttft_ms"] == pytest.approx(150) and v["p99_itl_ms"] == pytest.approx(99)
    assert v["output_throughput"] == pytest.approx(5.0) and v["failed"] == 1


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT <= 150 ms: only r1 (100 ms) -> 1 request / 2 s = 0.5
    assert calculate_metrics(_timeline(), 2.0, {"ttft": 150}).request_goodput == 0.5
    # TPOT <= 50 ms: r1 (66.7) fails; r2 has no TPOT, so it cannot break the bound -> 1 / 2 s
    assert calculate_metrics(_timeline(), 2.0, {"tpot": 50}).request_goodput == 0.5
    # both bounds generous: both completed requests; the failed one never counts
    m = calculate_metrics(_timeline(), 2.0, {"ttft": 1000, "e2el": 1000, "tpot": 1000})
    assert m.request_goodput == 1.0 and m.record_metrics()["goodput"] == 1.0
    # E2E <= 250: r2 only
    assert calculate_metrics(_timeline(), 1.0, {"e2el": 250}).request_goodput == 1.0


def test_edge_cases_zero_one_and_all_failed():
    empty = calculate_metrics([], 0.0)
    assert (empty.completed, empty.failed, empty.output_throughput) == (0, 0, 0.0)
    assert empty.ttft.mean is None and empty.itl.p99 is None
    assert set(empty.record_metrics()) == {"completed", "failed", "request_throughput",
                                           "out_tok_s", "total_tok_s"}
    one = calculate_metrics([RequestResult(True, 5, 3, 0.0, 0.01, [0.02, 0.04], 0.07)], 0.5)
    assert one.ttft.p95 == one.ttft.p99 == one.ttft.median == pytest.approx(10)
    assert one.tpot.mean == pytest.approx(30)  # (70 - 10) / 2
    assert one.output_throughput == pytest.approx(6.0)
    dead = calculate_metrics([RequestResult(False, 5, error="x")] * 3, 1.0, {"ttft": 10})
    assert (dead.completed, dead.failed, dead.request_goodput) == (0, 3, 0.0)
    assert dead.e2el.median is None
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics(_timeline(), 0.0)


def test_slo_validation_and_cost():
    with pytest.raises(ValueError, match="unknown SLO"):
        check_slos({"itl": 5})
    with pytest.raises(ValueError, match="positive"):
        check_slos({"ttft": -1})
    # $2/h for half an hour made 1e6 tokens: $1 per million
    assert usd_per_million_output_tokens(2.0, 1, 1800, 1_000_000) == pytest.approx(1.0)
    assert usd_per_million_output_tokens(2.0, 4, 1800, 2_000_000) == pytest.approx(2.0)
    assert usd_per_million_output_tokens(2.0, 1, 10, 0) is None


def test_arrivals_are_poisson_with_the_requested_rate():
    gaps = arrival_gaps(20000, LoadPoint(request_rate=4.0), seed=1)
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    # exponential gaps: standard deviation equals the mean; burstiness 4 makes them regular
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert sd == pytest.approx(mean, rel=0.05)
    regular = arrival_gaps(20000, LoadPoint(4.0, burstiness=4.0), seed=1)
    rmean = sum(regular) / len(regular)
    assert rmean == pytest.approx(0.25, rel=0.03)
    assert math.sqrt(sum((g - rmean) ** 2 for g in regular) / len(regular)) < 0.6 * rmean
    assert arrival_gaps(3, LoadPoint()) == [0.0, 0.0, 0.0]
    assert arrival_gaps(5, LoadPoint(2.0), seed=3) == arrival_gaps(5, LoadPoint(2.0), seed=3)
    for bad in (dict(request_rate=0), dict(max_concurrency=0), dict(burstiness=0)):
        with pytest.raises(ValueError):
            LoadPoint(**bad)


class _Fake(Backend):
    """Sleeps per request; records how many ran at once; fails requests asking 0 tokens."""
    name = "fake"

    def __init__(self, cap=None):
        self.max_concurrency = cap
        self.inflight = self.peak = 0

    async def generate(self, request):
        import time
        start = time.perf_counter()
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        await asyncio.sleep(0.02)
        self.inflight -= 1
        if request.max_tokens == 0:
            return RequestResult(False, request.prompt_len, start=start, error="no tokens")
        now = time.perf_counter()
        return RequestResult(True, request.prompt_len, request.max_tokens, start,
                             now - start, [], now - start)


def test_load_generator_caps_concurrency_and_keeps_failures():
    reqs = [BenchRequest([1, 2], 2, 0 if i == 3 else 4) for i in range(10)]
    fake = _Fake()
    results, duration = asyncio.run(run_load(fake, reqs, LoadPoint(max_concurrency=3),
                                             progress=False))
    assert fake.peak == 3 and len(results) == 10 and duration >= 4 * 0.02
    assert [r.success for r in results].count(False) == 1 and results[3].error == "no tokens"
    capped = _Fake(cap=1)  # a backend without batching is never sent two at once
    asyncio.run(run_load(capped, reqs[:4], LoadPoint(), progress=False))
    assert capped.peak == 1
    free = _Fake()
    asyncio.run(run_load(free, reqs, LoadPoint(), progress=False))
    assert free.peak == 10


def test_gpu_monitor_with_a_fake_nvml_and_without_one():
    calls = []
    fake = SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("down"),
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=40 + 10 * len(calls)),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=2**30 * 3))
    with GpuMonitor(0, interval_s=0.005, nvml=fake) as mon:
        import time
        time.sleep(0.05)
    s = mon.samples.summary()
    assert mon.unavailable is None and calls[0] == "init" and calls[-1] == "down"
    assert len(mon.samples.util_pct) >= 3 and s["gpu_mem_used_gib_max"] == pytest.approx(3.0)
    assert s["gpu_util_pct_max"] >= s["gpu_util_pct_mean"] >= 40

    def broken():
        raise RuntimeError("driver not loaded")
    with GpuMonitor(nvml=SimpleNamespace(nvmlInit=broken)) as mon:
        pass
    assert mon.samples.summary() == {} and "driver not loaded" in mon.unavailable
