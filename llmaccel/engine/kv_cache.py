"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import logging

import torch

from llmaccel.errors import LLMAccelError
from llmaccel.models.transformer import TransformerForCausalLM

logger = logging.getLogger(__name__)


def bytes_per_block(model: TransformerForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    per_token = sum(2 * a.num_kv_heads * a.head_dim for a in model.attention_layers())
    return per_token * block_size * dtype.itemsize


def num_blocks_for_budget(model: TransformerForCausalLM, block_size: int, dtype: torch.dtype,
                          device: torch.device, gpu_memory_utilization: float,
                          cpu_kv_cache_gib: float, max_blocks_useful: int) -> int:
    """GPU: what is left of total * utilization after weights and the profiled peak of a
    forward pass (measured by the caller before this). CPU: a fixed budget. Never more than
    `max_blocks_useful` (enough for max_num_seqs full-length sequences)."""
    per_block = bytes_per_block(model, block_size, dtype)
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        budget = total * gpu_memory_utilization - torch.cuda.max_memory_allocated(device)
    else:
        budget = cpu_kv_cache_gib * 2**30
    blocks = min(int(budget // per_block), max_blocks_useful)
    if blocks < 1:
        raise LLMAccelError(f"no memory left for the KV cache ({budget / 2**30:.2f} GiB after "
                            "weights and activations); raise gpu_memory_utilization or use a "
                            "smaller model")
    return blocks


def allocate_kv_caches(model: TransformerForCausalLM, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer. Zeroed: kernels
    that read a whole block before masking must never meet NaN garbage."""
    return [torch.zeros(2, num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=dtype,
                        device=device) for a in model.attention_layers()]
