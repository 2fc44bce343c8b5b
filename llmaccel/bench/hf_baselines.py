"""HF transformers baselines on the same shapes, with random weights, as docs/workloads.md's peers:

- `hf-eager` (W1): `generate` with the default dynamic cache, no compilation.
- `hf-static-compile` (W1): `generate` with `cache_implementation="static"`. On CUDA, transformers
  5.x then compiles the decode forward itself (`generation_config.compile_config`, whose default
  is inductor with mode "reduce-overhead", i.e. CUDA graphs); the prefill stays eager.
- `hf-cb` (W2): continuous batching through `model.generate_batch`, defaults except that block
  sharing is off (see `run_hf_cb_w2`).

Greedy throughout; EOS can never end a request early (min_new_tokens = max_new_tokens for
`generate`, eos_token_id=-1 for `generate_batch`, which drops negative ids from its EOS set).
Tokens are counted from what came back, not assumed.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from llmaccel.bench import hardware as hw
from llmaccel.bench.engine_runs import EngineSettings, w1_mean_context, w1_records, w2_config
from llmaccel.bench.results import Record, RunMeta, make_record
from llmaccel.bench.workloads import W1Spec, W2Spec, w1_prompt, w2_prompts

logger = logging.getLogger(__name__)
GIB = 2**30
HF_EAGER, HF_STATIC, HF_CB = "hf-eager", "hf-static-compile", "hf-cb"
HF_W1_BACKENDS = (HF_EAGER, HF_STATIC)
# Compilation happens in the first static-cache run, CUDA-graph recording in the next calls
# of the compiled forward; two full runs keep both out of the timed repeats.
STATIC_WARMUP_RUNS = 2


def build_hf_model(model: str, dtype: str, device: torch.device):
    """AutoModelForCausalLM from the shape's (or directory's) config, random init, on device."""
    from transformers import AutoModelForCausalLM

    from llmaccel.models.config import make_model_config, parse_dtype

    hf_config = make_model_config(model, load_format="dummy").hf_config
    torch_dtype = parse_dtype(dtype, hf_config, device)
    hw.release_memory()
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
    return hf.eval()


def _facts(hf) -> dict[str, Any]:
    import transformers

    return {"transformers": transformers.__version__, "dtype": str(hf.dtype),
            "attn_implementation": getattr(hf.config, "_attn_implementation", None)}


def _first_eos(hf) -> int | None:
    eos = hf.generation_config.eos_token_id
    eos = hf.config.eos_token_id if eos is None else eos
    return eos[0] if isinstance(eos, (list, tuple)) and eos else eos


# -- W1: generate -------------------------------------------------------------------------------
def run_hf_w1(backend: str, model: str, spec: W1Spec, settings: EngineSettings, meta: RunMeta,
              copy: hw.CopyBandwidth) -> list[Record]:
    if backend not in HF_W1_BACKENDS:
        raise ValueError(f"{backend} does not run W1 (W1 baselines: {HF_W1_BACKENDS})")
    hf = build_hf_model(model, settings.dtype, hw.default_device())
    try:
        return _measure_w1(hf, backend, model, spec, settings, meta, copy)
    finally:
        del hf
        if backend == HF_STATIC:
            torch._dynamo.reset()  # compiled graphs and their CUDA-graph pools hold memory
        hw.release_memory()


def _w1_generation_config(hf, backend: str, spec: W1Spec):
    from transformers import CompileConfig, GenerationConfig

    eos = _first_eos(hf)
    kwargs: dict[str, Any] = {"max_new_tokens": spec.new_tokens,
                              "min_new_tokens": spec.new_tokens, "do_sample": False,
                              "eos_token_id": eos, "pad_token_id": eos}
    if backend == HF_STATIC:
        kwargs["cache_implementation"] = "static"
        kwargs["compile_config"] = CompileConfig()  # transformers' defaults, stated explicitly
    return GenerationConfig(**kwargs)


def _generate(hf, input_ids: torch.Tensor, gen) -> tuple[int, float]:
    """(new tokens, seconds) of one generate(), device synchronized on both sides."""
    mask = torch.ones_like(input_ids)
    hw.synchronize(input_ids.device)
    start = time.perf_counter()
    out = hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)
    hw.synchronize(input_ids.device)
    return out.shape[1] - input_ids.shape[1], time.perf_counter() - start


def _measure_w1(hf, backend: str, model: str, spec: W1Spec, settings: EngineSettings,
                meta: RunMeta, copy: hw.CopyBandwidth) -> list[Record]:
    device = next(hf.parameters()).device
    ids = torch.tensor([w1_prompt(spec, hf.config.vocab_size)], device=device)
    gen = _w1_generation_config(hf, backend, spec)
    warmups = STATIC_WARMUP_RUNS if backend == HF_STATIC else 1
    for _ in range(warmups):
        _generate(hf, ids, gen)
    rates = []
    for _ in range(settings.repeats):
        n, seconds = _generate(hf, ids, gen)
        if n != spec.new_tokens:
            raise RuntimeError(f"generate returned {n} new tokens, expected {spec.new_tokens}")
        rates.append(n / seconds)
    config = {"prompt_len": spec.prompt_len, "new_tokens": spec.new_tokens, "batch": 1,
              "seed": spec.seed, "warmup_runs": warmups, **_facts(hf),
              "cache": "static" if backend == HF_STATIC else "dynamic"}
    if backend == HF_STATIC:
        # Set by transformers when generate() took its compiled path (CUDA only).
        config["compiled"] = getattr(hf, "_compiled_call", None) is not None
        config["compile_config"] = gen.compile_config.to_dict()
    roof = hw.decode_roofline(hf, hf.config, hf.dtype, w1_mean_context(spec),
                              statistics.median(rates), copy)
    return w1_records(meta, model, backend, config, rates, roof)


# -- W2: continuous batching -------------------------------------------------------------------
def run_hf_cb_w2(model: str, spec: W2Spec, settings: EngineSettings,
                 meta: RunMeta) -> list[Record]:
    hf = build_hf_model(model, settings.dtype, hw.default_device())
    try:
        return _measure_cb_w2(hf, model, spec, settings, meta)
    finally:
        try:
            hf.destroy_cached_continuous_batching_manager()
        except Exception:  # cleanup must not hide the measurement's outcome
            logger.exception("destroying the continuous batching manager failed")
        del hf
        hw.release_memory()


def _cb_output_lengths(results: dict, num_requests: int) -> list[int]:
    """Generated tokens per request; a missing or failed request is an error, not a zero."""
    failed = {k: v.error for k, v in results.items() if getattr(v, "error", None)}
    if len(results) != num_requests or failed:
        raise RuntimeError(f"generate_batch returned {len(results)} of {num_requests} "
                           f"requests; failed: {dict(list(failed.items())[:3])}")
    return [len(v.generated_tokens) for v in results.values()]


def _measure_cb_w2(hf, model: str, spec: W2Spec, settings: EngineSettings,
                   meta: RunMeta) -> list[Record]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    prompts = w2_prompts(spec, hf.config.vocab_size)
    gen = GenerationConfig(max_new_tokens=spec.new_tokens, do_sample=False, eos_token_id=-1)
    # The manager persists across calls so its setup (cache allocation, CUDA-graph warm-up)
    # stays out of the timed repeats; it is sized from the first call's workload, so the
    # warm-up is the full workload. Block sharing is off because a persistent manager keeps
    # prefix hashes across calls: a repeat would otherwise reuse the previous repeat's prefill
    # (our engine runs W2 with its prefix cache off for the same reason).
    cb_config = ContinuousBatchingConfig(allow_block_sharing=False)

    def run() -> dict:
        return hf.generate_batch(inputs=prompts, generation_config=gen,
                                 continuous_batching_config=cb_config,
                                 persistent_manager=True, progress_bar=False)

    device = next(hf.parameters()).device
    _cb_output_lengths(run(), len(prompts))  # warm-up
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rates, lengths = [], []
    for _ in range(settings.repeats):
        hw.synchronize(device)
        start = time.perf_counter()
        results = run()
        hw.synchronize(device)
        seconds = time.perf_counter() - start
        lengths = _cb_output_lengths(results, len(prompts))
        rates.append(sum(lengths) / seconds)
    config = {**w2_config(spec, prompts), "output_tokens": sum(lengths),
              "output_len_min_max": [min(lengths), max(lengths)],
              "warmup": "the full workload once (persistent manager)",
              "continuous_batching_config": {"allow_block_sharing": False},
              "eos_token_id": -1, **_facts(hf)}
    records = [make_record(meta, "W2", model, HF_CB,
                           {**config, "repeats": [round(r, 3) for r in rates]},
                           "out_tok_s", statistics.median(rates))]
    if cuda:
        records.append(make_record(
            meta, "W2", model, HF_CB,
            {**config, "note": "max_memory_allocated over the timed repeats: weights, the "
             "paged cache transformers sizes from free memory, and activations"},
            "peak_mem_gib", torch.cuda.max_memory_allocated(device) / GIB))
    return records
