"""`llmaccel bench latency | throughput | serve | prefix`: docs/workloads.md's W1-W4 through any
backend (llmaccel in process, HF generate, an OpenAI-compatible server), each request timed
by its client, metrics computed once for all backends (`metrics.calculate_metrics`).

A suite returns a `SuiteOutput`: records in docs/workloads.md's format and per-request rows for
the `.requests.jsonl` sidecar that `llmaccel report` draws latency CDFs from.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from llmaccel.bench import hardware as hw
from llmaccel.bench.backends.base import Backend, BenchRequest
from llmaccel.bench.gpu_monitor import GpuMonitor
from llmaccel.bench.load import LoadPoint, run_load
from llmaccel.bench.metrics import (
    BenchmarkMetrics,
    RequestResult,
    calculate_metrics,
    usd_per_million_output_tokens,
)
from llmaccel.bench.results import PREFIX_OFF, PREFIX_ON, Record, RunMeta, make_record
from llmaccel.bench.workloads import (
    W1Spec,
    W2Spec,
    W3Spec,
    W4Spec,
    w1_prompt,
    w2_prompts,
    w3_requests,
    w4_prefix,
    w4_prompts,
)

GIB = 2**30


@dataclass(frozen=True)
class SuiteSettings:
    model: str                       # the name records carry (a shape, a file's stem, ...)
    load_format: str = "auto"
    repeats: int = 3
    warmup: int = 1
    slos_ms: dict[str, float] = field(default_factory=dict)
    usd_per_gpu_hour: float | None = None
    num_gpus: int = 1
    progress: bool = True


@dataclass
class SuiteOutput:
    records: list[Record] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # .requests.jsonl rows


def _request_rows(results: list[RequestResult], workload: str, model: str, backend: str,
                  load: str, **extra: Any) -> list[dict[str, Any]]:
    return [{"workload": workload, "model": model, "backend": backend, "load": load, **extra,
             **r.as_row()} for r in results]


def _local_cuda(backend: Backend) -> torch.device | None:
    inputs = backend.roofline_inputs()
    if inputs is None:
        return None
    device = next(inputs[0].parameters()).device
    return device if device.type == "cuda" else None


class _Measured:
    """One timed run of a backend: results, duration, and what was sampled around it (peak
    allocated memory of a local CUDA model, NVML utilization)."""

    def __init__(self, results: list[RequestResult], duration: float,
                 extra: dict[str, float], notes: dict[str, Any]) -> None:
        self.results, self.duration, self.extra, self.notes = results, duration, extra, notes


async def measure(backend: Backend, requests: list[BenchRequest], point: LoadPoint,
                  settings: SuiteSettings, description: str, seed: int = 0) -> _Measured:
    cuda = _local_cuda(backend)
    if cuda is not None:
        hw.synchronize(cuda)
        torch.cuda.reset_peak_memory_stats(cuda)
    # NVML sees the whole GPU: with a remote server on this machine that is the server's use.
    with GpuMonitor(cuda.index or 0 if cuda is not None else 0) as mon:
        results, duration = await run_load(backend, requests, point, seed=seed,
                                           description=description,
                                           progress=settings.progress)
    extra = dict(mon.samples.summary())
    notes: dict[str, Any] = {}
    if mon.unavailable:
        notes["gpu_monitor"] = mon.unavailable
    if cuda is not None:
        extra["peak_mem_gib"] = torch.cuda.max_memory_allocated(cuda) / GIB
    return _Measured(results, duration, extra, notes)


def metric_records(meta: RunMeta, workload: str, settings: SuiteSettings, backend: Backend,
                   config: dict[str, Any], metrics: BenchmarkMetrics,
                   extra: dict[str, float]) -> list[Record]:
    values = {**metrics.record_metrics(), **extra}
    if settings.usd_per_gpu_hour is not None:
        cost = usd_per_million_output_tokens(settings.usd_per_gpu_hour, settings.num_gpus,
                                             metrics.duration_s, metrics.total_output_tokens)
        if cost is not None:
            values["usd_per_m_out_tok"] = cost
            config = {**config, "usd_per_gpu_hour": settings.usd_per_gpu_hour,
                      "num_gpus": settings.num_gpus}
    if metrics.slos_ms:
        config = {**config, "slos_ms": metrics.slos_ms}
    config = {**config, "duration_s": round(metrics.duration_s, 4),
              "total_input_tokens": metrics.total_input_tokens,
              "total_output_tokens": metrics.total_output_tokens}
    return [make_record(meta, workload, settings.model, backend.name, config, name, value,
                        load_format=backend.load_format) for name, value in values.items()]


def _errors(results: list[RequestResult]) -> list[str]:
    return list(dict.fromkeys(r.error for r in results if not r.success))[:3]


def with_backend(backend: Backend,
                 body: Callable[[], Awaitable[SuiteOutput]]) -> SuiteOutput:
    """Start, run, close (always), in one event loop (an engine's and an HTTP client's
    async state belong to the loop that made them); a backend's memory is gone before the
    next one starts."""
    async def run() -> SuiteOutput:
        await backend.start()
        try:
            return await body()
        finally:
            await backend.close()
    return asyncio.run(run())


def _vocab(backend: Backend) -> int:
    vocab = backend.vocab_size()
    if vocab is None:
        raise ValueError(f"{backend.name}: random-token prompts need the model's vocabulary "
                         "size: pass --vocab-size (or --tokenizer)")
    return vocab


# -- W1 latency --------------------------------------------------------------------------------
async def latency(backend: Backend, spec: W1Spec, settings: SuiteSettings, meta: RunMeta,
            copy: hw.CopyBandwidth | None = None) -> SuiteOutput:
    """Batch-1 requests in turn: `warmup` untimed, then `repeats` timed. tok_s = new tokens /
    E2E latency of each request (prefill included), median over repeats."""
    prompt = w1_prompt(spec, _vocab(backend))
    request = BenchRequest(prompt, len(prompt), spec.new_tokens)
    point = LoadPoint()
    for i in range(settings.warmup):
        await measure(backend, [request], point, settings, f"W1 warm-up {i + 1}")
    runs = [await measure(backend, [request], point, settings, f"W1 repeat {i + 1}")
            for i in range(settings.repeats)]
    results = [r for m in runs for r in m.results]
    ok = [r for r in results if r.success]
    out = SuiteOutput(rows=_request_rows(results, "W1", settings.model, backend.name,
                                         "batch=1"))
    config = {"prompt_len": spec.prompt_len, "new_tokens": spec.new_tokens, "batch": 1,
              "seed": spec.seed, "warmup_runs": settings.warmup, **backend.facts(),
              "output_lens": sorted({r.output_len for r in ok}), "errors": _errors(results)}
    if not ok:
        out.records.append(make_record(meta, "W1", settings.model, backend.name, config,
                                       "failed", len(results)))
        return out
    tok_s = [r.output_len / r.latency for r in ok]
    metrics = calculate_metrics(results, sum(m.duration for m in runs), settings.slos_ms)
    extra = {"tok_s": statistics.median(tok_s)}
    for m in runs:
        for k, v in m.extra.items():
            extra[k] = max(extra.get(k, v), v) if k.endswith("max") or k.startswith("peak") \
                else v
    config = {**config, "tok_s_repeats": [round(x, 3) for x in tok_s],
              "definition": "tok_s = new tokens / E2E latency (prefill included)",
              **runs[-1].notes}
    inputs = backend.roofline_inputs()
    if inputs is not None and copy is not None:
        module, hf_config, dtype = inputs
        roof = hw.decode_roofline(module, hf_config, dtype,
                                  spec.prompt_len + spec.new_tokens / 2, extra["tok_s"], copy)
        extra["gbps"], extra["pct_roofline"] = roof["gbps"], roof["pct_roofline"]
        config = {**config, **roof["config"]}
    out.records += metric_records(meta, "W1", settings, backend, config, metrics, extra)
    return out


# -- W2 throughput -----------------------------------------------------------------------------
async def throughput(backend: Backend, spec: W2Spec, settings: SuiteSettings,
               meta: RunMeta) -> SuiteOutput:
    """Every request submitted at once; the warm-up sends the same prompts with a few new
    tokens (graph capture, autotuning, allocation stay out of the timed repeats). Each metric
    is the median over repeats; rows keep every repeat."""
    prompts = w2_prompts(spec, _vocab(backend))
    requests = [BenchRequest(p, len(p), spec.new_tokens) for p in prompts]
    point = LoadPoint()
    for i in range(settings.warmup):
        warm = [BenchRequest(p, len(p), min(16, spec.new_tokens)) for p in prompts]
        await measure(backend, warm, point, settings, f"W2 warm-up {i + 1}")
    runs = [await measure(backend, requests, point, settings, f"W2 repeat {i + 1}")
            for i in range(settings.repeats)]
    config = {"num_requests": spec.num_requests, "input_len": [spec.input_min, spec.input_max],
              "new_tokens": spec.new_tokens, "seed": spec.seed, "submission": "all at once",
              **backend.facts(), **runs[-1].notes}
    return _median_of_runs(backend, runs, "W2", "all-at-once", config, settings, meta)


def _median_of_runs(backend: Backend, runs: list[_Measured], workload: str, load: str,
                    config: dict[str, Any], settings: SuiteSettings,
                    meta: RunMeta) -> SuiteOutput:
    out = SuiteOutput()
    per_run: list[dict[str, float]] = []
    for i, m in enumerate(runs):
        out.rows += _request_rows(m.results, workload, settings.model, backend.name, load,
                                  repeat=i, **({"variant": config["variant"]}
                                               if "variant" in config else {}))
        metrics = calculate_metrics(m.results, m.duration, settings.slos_ms)
        recs = metric_records(meta, workload, settings, backend, config, metrics, m.extra)
        per_run.append({r.metric: r.value for r in recs})
    errors = _errors([r for m in runs for r in m.results])
    names = list(dict.fromkeys(k for d in per_run for k in d))
    for name in names:
        values = [d[name] for d in per_run if name in d]
        cfg = {**config, "repeats": values, "errors": errors,
               "statistic": "median over repeats"}
        out.records.append(make_record(meta, workload, settings.model, backend.name, cfg, name,
                                       statistics.median(values),
                                       load_format=backend.load_format))
    return out


# -- W3 serving --------------------------------------------------------------------------------
async def serve(backend: Backend, spec: W3Spec, points: list[LoadPoint], settings: SuiteSettings,
          meta: RunMeta) -> SuiteOutput:
    """One run per load point over the same seeded requests (a serving run is one sample, as
    in `vllm bench serve`); a short warm-up first."""
    requests = [BenchRequest(p, len(p), n) for p, n in w3_requests(spec, _vocab(backend))]
    if settings.warmup:
        warm = [BenchRequest(r.prompt, r.prompt_len, min(8, r.max_tokens))
                for r in requests[:4]]
        await measure(backend, warm, LoadPoint(), settings, "W3 warm-up")
    out = SuiteOutput()
    for point in points:
        m = await measure(backend, requests, point, settings, f"W3 {point.label}", seed=spec.seed)
        metrics = calculate_metrics(m.results, m.duration, settings.slos_ms)
        config = {"num_prompts": spec.num_prompts, "input_len": [spec.input_min,
                                                                  spec.input_max],
                  "output_len": [spec.output_min, spec.output_max], "seed": spec.seed,
                  **point.config(), "load": point.label, "errors": _errors(m.results),
                  **backend.facts(), **m.notes}
        out.records += metric_records(meta, "W3", settings, backend, config, metrics, m.extra)
        out.rows += _request_rows(m.results, "W3", settings.model, backend.name, point.label)
    return out


# -- W4 shared prefix --------------------------------------------------------------------------
async def prefix(backend: Backend, spec: W4Spec, settings: SuiteSettings, meta: RunMeta,
           variant: str | None = None) -> SuiteOutput:
    """Each round: one request with the system prompt alone (a running server has seen it),
    then the batch with new tails, all at once. Median over rounds of each metric."""
    vocab = _vocab(backend)
    point = LoadPoint()

    def batch(round_index: int) -> list[BenchRequest]:
        return [BenchRequest(p, len(p), spec.new_tokens)
                for p in w4_prompts(spec, vocab, round_index)]

    head = w4_prefix(spec, vocab)
    for i in range(settings.warmup):
        await measure(backend, batch(-1 - i), point, settings, "W4 warm-up")
    runs = []
    for r in range(settings.repeats):
        await measure(backend, [BenchRequest(head, len(head), 1)], point, settings, "W4 prime")
        runs.append(await measure(backend, batch(r), point, settings, f"W4 round {r + 1}"))
    config = {"num_requests": spec.num_requests, "prefix_len": spec.prefix_len,
              "unique_len": spec.unique_len, "new_tokens": spec.new_tokens, "seed": spec.seed,
              "submission": "all at once, after one request with the prefix alone",
              **({"variant": variant} if variant else {}), **backend.facts(), **runs[-1].notes}
    return _median_of_runs(backend, runs, "W4", "all-at-once", config, settings, meta)


PREFIX_VARIANTS = {False: PREFIX_OFF, True: PREFIX_ON}

__all__ = ["PREFIX_VARIANTS", "SuiteOutput", "SuiteSettings", "latency", "measure",
           "metric_records", "prefix", "serve", "throughput", "with_backend"]
