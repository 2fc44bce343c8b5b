"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import logging

import torch

from llmaccel.engine.config import KV_CACHE_DTYPES
from llmaccel.errors import LLMAccelError
from llmaccel.kernels import triton_supports_fp8
from llmaccel.models.transformer import TransformerForCausalLM

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                           attention_backend: str) -> torch.dtype:
    """EngineConfig.kv_cache_dtype -> the cache tensors' dtype: 'auto' is the model dtype;
    'fp8' / 'fp8_e4m3' is float8_e4m3fn, once this torch build, the device and the (resolved)
    attention backend are known to store and read it."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise LLMAccelError(f"unknown kv_cache_dtype '{name}' "
                            f"(allowed: {', '.join(KV_CACHE_DTYPES)})")
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise LLMAccelError(f"kv_cache_dtype '{name}' needs a torch build with float8 types "
                            f"(torch >= 2.1; this is {torch.__version__}); use "
                            "kv_cache_dtype 'auto'")
    if attention_backend == "triton" and not triton_supports_fp8(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise LLMAccelError(f"kv_cache_dtype '{name}' with the triton attention backend needs "
                            f"a GPU of compute capability >= 8.9 (Ada, Hopper), this one is "
                            f"{major}.{minor}; use attention backend 'torch' or 'flex', or "
                            "kv_cache_dtype 'auto'")
    try:  # what every backend does with the cache: cast in, view as bytes, cast out
        torch.ones(2, device=device).to(fp8).view(torch.uint8).view(fp8).to(model_dtype)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise LLMAccelError(f"kv_cache_dtype '{name}': this torch build cannot use float8 "
                            f"tensors on {device.type} ({e}); use kv_cache_dtype 'auto'") from None
    return fp8


def bytes_per_block(model: TransformerForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    per_token = sum(2 * a.num_kv_heads * a.head_dim for a in model.attention_layers())
    return per_token * block_size * dtype.itemsize


def num_blocks_for_budget(model: TransformerForCausalLM, block_size: int, dtype: torch.dtype,
                          device: torch.device, gpu_memory_utilization: float,
                          cpu_kv_cache_gib: float, max_blocks_useful: int,
                          extra_bytes_per_block: int = 0) -> int:
    """GPU: what is left of total * utilization after weights and the profiled peak of a
    forward pass (measured by the caller before this). CPU: a fixed budget. Never more than
    `max_blocks_useful` (enough for max_num_seqs full-length sequences).
    `extra_bytes_per_block`: another pool with as many blocks shares the budget (a draft
    model's KV for speculative decoding)."""
    per_block = bytes_per_block(model, block_size, dtype) + extra_bytes_per_block
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
    that read a whole block before masking must never meet NaN garbage. One-byte (FP8) caches
    are zeroed as bytes (0x00 is +0.0), which needs no float8 fill kernel on the device."""
    shapes = [(2, num_blocks, block_size, a.num_kv_heads, a.head_dim)
              for a in model.attention_layers()]
    if dtype.itemsize == 1 and dtype.is_floating_point:
        return [torch.zeros(s, dtype=torch.uint8, device=device).view(dtype) for s in shapes]
    return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
