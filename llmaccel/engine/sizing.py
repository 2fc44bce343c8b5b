"""Start-up sizing of an engine: which CUDA-graph row counts to capture, and how many KV blocks
fit after weights and the activations of the largest step (measured by running it once)."""

from __future__ import annotations

import torch

from llmaccel.engine.config import EngineConfig
from llmaccel.engine.cuda_graph import default_capture_sizes
from llmaccel.engine.kv_cache import num_blocks_for_budget
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.transformer import TransformerForCausalLM


def rows_per_seq(config: EngineConfig, draft: bool = False) -> int:
    """The most decode rows one sequence takes in a graphed step: 1, or with speculation the
    last token and k drafts (a verify step), or 2 for the draft model (its catch-up: the
    target's token after a fully accepted step, and the last draft); a draft head catches up
    on as many as a verify step has."""
    spec = config.speculative_config
    if spec is None:
        return 1
    if draft and spec.method == "draft":
        return 2
    # a verify step (the longest lookup's with ngram_first); a draft head's catch-up
    # recomputes the accepted drafts and one more
    return 1 + spec.max_drafts


# Graphs are captured up to at least this many rows, even where decode steps never have as
# many: small prefill steps replay them, one row per token (ModelRunner.prefill_rows_kv_bytes),
# instead of launching ~10 kernels per layer from the host (vLLM's default largest capture
# size is 512 too).
PREFILL_GRAPH_ROWS = 512


def capture_sizes(config: EngineConfig, device: torch.device, draft: bool = False,
                  max_num_batched_tokens: int | None = None) -> list[int] | None:
    """The row counts to capture as CUDA graphs (None: run eagerly): every decode step's, and
    prefill steps' up to PREFILL_GRAPH_ROWS (within the step token budget)."""
    if config.enforce_eager or device.type != "cuda":
        return None
    if config.cudagraph_capture_sizes is not None:
        # As given, up to what a step can hold: sizes beyond the decode steps' serve prefill
        # steps as rows (benchmarks give a plain engine the sizes a speculative one captures,
        # so both prefill the same way).
        cap = max_num_batched_tokens or max(config.cudagraph_capture_sizes)
        return sorted({s for s in config.cudagraph_capture_sizes if s <= cap}) or None
    most = max(config.max_num_seqs * rows_per_seq(config, draft),
               min(PREFILL_GRAPH_ROWS, max_num_batched_tokens or PREFILL_GRAPH_ROWS))
    # A step that runs as rows never has more, so larger graphs would be dead weight.
    return default_capture_sizes(most)


def profile_num_blocks(config: EngineConfig, model: TransformerForCausalLM, max_model_len: int,
                       max_num_batched_tokens: int, kv_cache_dtype: torch.dtype,
                       device: torch.device, extra_bytes_per_block: int = 0) -> int:
    """KV blocks for the memory left: on GPU, run the largest step once without a cache to
    measure activation memory; `extra_bytes_per_block`: other pools with as many blocks
    that share the budget (a draft model's or head's KV, the target's features for a head)."""
    if device.type == "cuda":
        # Budget from this engine's own peak: weights + the profiling step (an earlier peak in
        # the same process, e.g. another model since freed, must not count).
        torch.cuda.reset_peak_memory_stats(device)
        n = min(max_num_batched_tokens, max_model_len)
        with torch.inference_mode():
            hidden = model(torch.zeros(n, dtype=torch.long, device=device),
                           torch.arange(n, device=device),
                           AttentionMetadata.for_prefill([n], device))
            # logits for the most rows a step samples (a verify step: k + 1 per sequence)
            model.compute_logits(hidden[-min(n, config.max_num_seqs * rows_per_seq(config)):])
        torch.cuda.synchronize(device)
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    return num_blocks_for_budget(model, config.block_size, kv_cache_dtype, device,
                                 config.gpu_memory_utilization, config.cpu_kv_cache_gib, useful,
                                 extra_bytes_per_block=extra_bytes_per_block)
