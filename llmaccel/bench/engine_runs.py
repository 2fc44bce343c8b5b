"""Our engine on W1 (batch-1 decode), W2 (offline throughput) and W4 (shared prefix).

Each run builds its own `LLM` (dummy weights, greedy, ignore_eos) and frees it before returning:
the engine sizes its KV pool from the memory that is free, so two engines (or an engine and an
HF baseline) must never be alive at once.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from llmaccel.bench import hardware as hw
from llmaccel.bench.results import OURS, PREFIX_OFF, PREFIX_ON, Record, RunMeta, make_record
from llmaccel.bench.workloads import (
    W1Spec,
    W2Spec,
    W4Spec,
    w1_prompt,
    w2_prompts,
    w4_prefix,
    w4_prompts,
)

logger = logging.getLogger(__name__)
GIB = 2**30
W1_WARMUP_RUNS = 2  # graph capture and kernel autotuning happen in the first; the second checks


@dataclass(frozen=True)
class EngineSettings:
    dtype: str = "bfloat16"
    attention_backend: str | None = None  # None: the engine's default
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # --engine-kw, any EngineConfig
    repeats: int = 3
    w2_warmup_tokens: int = 16
    quantization: str | None = None  # a llmaccel.quant.presets name (dummy codes); None: bf16
    variant: str | None = None  # a label for the table row (e.g. the kernels' settings)


def engine_kwargs(settings: EngineSettings, max_model_len: int,
                  forced: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keywords for `LLM`. Prefix caching is off by default: timed repeats send the same
    prompts, and a cache hit on the previous repeat's prompt would skip its prefill. The
    user's --engine-kw override the defaults; `forced` (what a workload compares) wins."""
    kwargs: dict[str, Any] = {"load_format": "dummy", "dtype": settings.dtype,
                              "max_model_len": max_model_len, "skip_tokenizer_init": True,
                              "enable_prefix_caching": False}
    if settings.attention_backend:
        kwargs["attention_backend"] = settings.attention_backend
    if settings.quantization:
        from llmaccel.quant.presets import preset_config
        kwargs["hf_overrides"] = {"quantization_config": preset_config(settings.quantization)}
    return {**kwargs, **settings.engine_kwargs, **(forced or {})}


def quant_facts(settings: EngineSettings) -> dict[str, Any]:
    """config.quantization (docs/workloads.md's names) and the table row variant."""
    labels = [v for v in (settings.quantization, settings.variant) if v]
    facts: dict[str, Any] = {"quantization": settings.quantization or (
        "bf16" if settings.dtype == "bfloat16" else settings.dtype)}
    if labels:
        facts["variant"] = ", ".join(labels)
    return facts


def build_llm(model: str, kwargs: dict[str, Any]):
    from llmaccel.engine.llm import LLM

    hw.release_memory()  # the engine budgets KV memory from the peak allocated so far
    return LLM(model, **kwargs)


def greedy(max_tokens: int):
    from llmaccel.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def timed_generate(llm, prompts: list[list[int]], params) -> tuple[list, float]:
    """generate() with the device synchronized on both sides, so the time covers the GPU work."""
    device = llm.engine.device
    hw.synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    hw.synchronize(device)
    elapsed = time.perf_counter() - start
    for o in outs:
        if o.error:
            raise RuntimeError(f"request rejected: {o.error}")
    return outs, elapsed


def _engine_facts(llm, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the engine actually ran with, for the record's config."""
    engine = llm.engine
    facts: dict[str, Any] = {"engine_kwargs": kwargs, "dtype": str(engine.model_config.dtype)}
    layers = engine.model.attention_layers()
    facts["attention_backend"] = getattr(layers[0].backend, "name", None) if layers else None
    graphs = engine.runner.graphs
    facts["cuda_graphs"] = graphs.sizes if graphs is not None else None
    facts["fused_decode"] = bool(getattr(engine.model.model.layers[0], "fuse_decode", False))
    from llmaccel.kernels import triton_available
    if triton_available():
        from llmaccel.kernels import pdl
        facts["pdl"] = pdl.enabled()
    facts["kv_pool_tokens"] = llm.get_stats().num_blocks * engine.config.block_size
    return facts


def _vocab(llm) -> int:
    return llm.engine.model_config.hf_config.vocab_size


# -- W1 ----------------------------------------------------------------------------------------
def run_w1(model: str, spec: W1Spec, settings: EngineSettings, meta: RunMeta,
           copy: hw.CopyBandwidth) -> list[Record]:
    kwargs = engine_kwargs(settings, spec.max_model_len)
    llm = build_llm(model, kwargs)
    try:
        return _measure_w1(llm, model, spec, settings, meta, copy, kwargs)
    finally:
        del llm  # the only reference: the engine's weights and KV pool go with it
        hw.release_memory()


def _measure_w1(llm, model: str, spec: W1Spec, settings: EngineSettings, meta: RunMeta,
                copy: hw.CopyBandwidth, kwargs: dict[str, Any]) -> list[Record]:
    prompt, params = w1_prompt(spec, _vocab(llm)), greedy(spec.new_tokens)
    for _ in range(W1_WARMUP_RUNS):
        timed_generate(llm, [prompt], params)
    tok_s, decode_tok_s, ttft_ms = [], [], []
    for _ in range(settings.repeats):
        (out,), seconds = timed_generate(llm, [prompt], params)
        n = len(out.outputs[0].token_ids)
        if n != spec.new_tokens:
            raise RuntimeError(f"generated {n} tokens, expected {spec.new_tokens}")
        tok_s.append(n / seconds)
        m = out.metrics
        if m is not None and m.first_token_time is not None and m.finished_time is not None:
            ttft_ms.append((m.first_token_time - m.arrival_time) * 1e3)
            if n > 1 and m.finished_time > m.first_token_time:
                decode_tok_s.append((n - 1) / (m.finished_time - m.first_token_time))
    config = {"prompt_len": spec.prompt_len, "new_tokens": spec.new_tokens, "batch": 1,
              "seed": spec.seed, "warmup_runs": W1_WARMUP_RUNS, **_engine_facts(llm, kwargs),
              **quant_facts(settings)}
    mc = llm.engine.model_config
    roof = hw.decode_roofline(llm.engine.model, mc.hf_config, mc.dtype, w1_mean_context(spec),
                              statistics.median(tok_s), copy)
    return w1_records(meta, model, OURS, config, tok_s, roof, decode_tok_s, ttft_ms)


def w1_mean_context(spec: W1Spec) -> float:
    """Mean context a batch-1 decode step reads: the prompt plus half the new tokens."""
    return spec.prompt_len + spec.new_tokens / 2


def w1_records(meta: RunMeta, model: str, backend: str, config: dict[str, Any],
               tok_s: list[float], roof: dict[str, Any], decode_tok_s: list[float] = (),
               ttft_ms: list[float] = ()) -> list[Record]:
    """The W1 records of one backend; shared with the HF baselines so both read alike."""
    definition = "new tokens / wall time of the whole request (prefill included)"
    records = [make_record(meta, "W1", model, backend,
                           {**config, "definition": definition, "repeats": _r(tok_s)},
                           "tok_s", statistics.median(tok_s))]
    if decode_tok_s:
        records.append(make_record(
            meta, "W1", model, backend,
            {**config, "definition": "(new tokens - 1) / (finished_time - first_token_time)",
             "repeats": _r(decode_tok_s)}, "decode_tok_s", statistics.median(decode_tok_s)))
    if ttft_ms:
        records.append(make_record(
            meta, "W1", model, backend,
            {**config, "definition": "first_token_time - arrival_time, median of repeats",
             "repeats": _r(ttft_ms)}, "ttft_ms_p50", statistics.median(ttft_ms)))
    roof_config = {**config, **roof["config"]}
    records.append(make_record(meta, "W1", model, backend, roof_config, "gbps", roof["gbps"]))
    records.append(make_record(meta, "W1", model, backend, roof_config, "pct_roofline",
                               roof["pct_roofline"]))
    return records


def _r(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


# -- W2 ----------------------------------------------------------------------------------------
def run_w2(model: str, spec: W2Spec, settings: EngineSettings, meta: RunMeta) -> list[Record]:
    kwargs = engine_kwargs(settings, spec.max_model_len)
    llm = build_llm(model, kwargs)
    try:
        return _measure_w2(llm, model, spec, settings, meta, kwargs)
    finally:
        del llm  # the only reference: the engine's weights and KV pool go with it
        hw.release_memory()


def _measure_w2(llm, model: str, spec: W2Spec, settings: EngineSettings, meta: RunMeta,
                kwargs: dict[str, Any]) -> list[Record]:
    prompts = w2_prompts(spec, _vocab(llm))
    # Warm-up on the workload's own prompts (every prefill chunk shape and decode batch size up
    # to all requests), with few new tokens: the engine has nothing sized by output length.
    warmup_tokens = min(settings.w2_warmup_tokens, spec.new_tokens)
    timed_generate(llm, prompts, greedy(warmup_tokens))
    cuda = llm.engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(llm.engine.device)
    rates, preemptions, out_tokens = [], [], 0
    for _ in range(settings.repeats):
        before = llm.get_stats().num_preemptions
        outs, seconds = timed_generate(llm, prompts, greedy(spec.new_tokens))
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if out_tokens != spec.new_tokens * len(prompts):
            raise RuntimeError(f"generated {out_tokens} tokens, expected "
                               f"{spec.new_tokens * len(prompts)} (ignore_eos)")
        rates.append(out_tokens / seconds)
        preemptions.append(llm.get_stats().num_preemptions - before)
    config = {**w2_config(spec, prompts), "output_tokens": out_tokens,
              "warmup": f"all prompts, {warmup_tokens} new tokens", "preemptions": preemptions,
              "prefix_caching": bool(kwargs.get("enable_prefix_caching")),
              **_engine_facts(llm, kwargs), **quant_facts(settings)}
    records = [make_record(meta, "W2", model, OURS, {**config, "repeats": _r(rates)},
                           "out_tok_s", statistics.median(rates))]
    if cuda:
        records.append(make_record(
            meta, "W2", model, OURS,
            {**config, "note": "max_memory_allocated over the timed repeats: weights, the "
             "preallocated KV pool (sized by gpu_memory_utilization) and activations"},
            "peak_mem_gib", torch.cuda.max_memory_allocated(llm.engine.device) / GIB))
    return records


def w2_config(spec: W2Spec, prompts: list[list[int]]) -> dict[str, Any]:
    return {"num_requests": spec.num_requests, "input_len": [spec.input_min, spec.input_max],
            "input_tokens": sum(map(len, prompts)), "new_tokens": spec.new_tokens,
            "seed": spec.seed, "submission": "all at once",
            "definition": "generated tokens / wall time of the whole batch"}


# -- W4 ----------------------------------------------------------------------------------------
def run_w4(model: str, spec: W4Spec, settings: EngineSettings, meta: RunMeta,
           prefix_caching: bool) -> list[Record]:
    kwargs = engine_kwargs(settings, spec.max_model_len, {"enable_prefix_caching": prefix_caching})
    llm = build_llm(model, kwargs)
    try:
        return _measure_w4(llm, model, spec, settings, meta, kwargs, prefix_caching)
    finally:
        del llm  # the only reference: the engine's weights and KV pool go with it
        hw.release_memory()


def _measure_w4(llm, model: str, spec: W4Spec, settings: EngineSettings, meta: RunMeta,
                kwargs: dict[str, Any], prefix_caching: bool) -> list[Record]:
    vocab = _vocab(llm)
    params = greedy(spec.new_tokens)
    timed_generate(llm, w4_prompts(spec, vocab, round_index=-1), params)  # warm-up round
    p50, p95, cached = [], [], []
    for r in range(settings.repeats):
        # A running server has seen the system prompt before: one request with it fills the
        # cache (when on) before the timed batch, whose tails are new this round.
        timed_generate(llm, [w4_prefix(spec, vocab)], greedy(1))
        outs, _ = timed_generate(llm, w4_prompts(spec, vocab, round_index=r), params)
        ttft = [(o.metrics.first_token_time - o.metrics.arrival_time) * 1e3 for o in outs]
        p50.append(float(np.percentile(ttft, 50)))
        p95.append(float(np.percentile(ttft, 95)))
        cached.append(statistics.mean(o.num_cached_tokens for o in outs))
    config = {"num_requests": spec.num_requests, "prefix_len": spec.prefix_len,
              "unique_len": spec.unique_len, "new_tokens": spec.new_tokens, "seed": spec.seed,
              "variant": PREFIX_ON if prefix_caching else PREFIX_OFF,
              "prefix_caching": prefix_caching, "submission": "all at once",
              "definition": "TTFT = first_token_time - arrival_time per request; percentile "
              "over the batch, median over repeats",
              "mean_cached_tokens": _r(cached), **_engine_facts(llm, kwargs)}
    return [make_record(meta, "W4", model, OURS, {**config, "repeats": _r(p50)},
                        "ttft_ms_p50", statistics.median(p50)),
            make_record(meta, "W4", model, OURS, {**config, "repeats": _r(p95)},
                        "ttft_ms_p95", statistics.median(p95))]
