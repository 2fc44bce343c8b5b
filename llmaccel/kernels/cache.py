"""Triton reshape_and_cache: write this step's key/value [T, kv_heads, d] into the paged KV cache.

KV cache layout [2, num_blocks, block_size, kv_heads, d]; token t goes to slot
slot_mapping[t] = block * block_size + offset, and slot -1 (padding) is skipped. One program
per token writes all its kv heads for both K and V: a single launch replacing two indexed
PyTorch scatters. Values are cast to the cache dtype on store.
Reference: `attention_ref.reshape_and_cache_ref` (re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmaccel.kernels.attention_ref import reshape_and_cache_ref

__all__ = ["reshape_and_cache", "reshape_and_cache_ref"]


@triton.jit
def _reshape_and_cache_kernel(
    Key, Value, KCache, VCache, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    num_kv_heads, head_dim, block_size,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    # Slot -1 is padding: every store is masked off (no early return needed).
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
    mask = mask & ((h[:, None] * 0 + slot) >= 0)
    block = slot // block_size
    off = slot % block_size
    dst = block * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(Key + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(Value + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key/value [T, kv_heads, d] (head dim contiguous; may be strided views) -> kv_cache
    [2, num_blocks, block_size, kv_heads, d] at slot_mapping [T] (int32/int64, -1 = skip),
    in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and kv_cache.shape[-2:] == (num_kv_heads, head_dim)
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride() == v_cache.stride()
    slot_mapping = slot_mapping.contiguous()
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, kv_cache.shape[2],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
