"""Triton reshape_and_cache: write this step's key/value [T, kv_heads, d] into the paged KV cache.

KV cache layout [2, num_blocks, block_size, kv_heads, d]; token t goes to slot
slot_mapping[t] = block * block_size + offset, and slot -1 (padding) is skipped. One program
per token writes all its kv heads for both K and V: a single launch replacing two indexed
PyTorch scatters. Values are cast to the cache dtype on store; an FP8 (e4m3) cache gets
clamp(x / scale, +-448) rounded to nearest even (see `attention_ref.quantize_kv`).
Reference: `attention_ref.reshape_and_cache_ref` (re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.pdl import pdl_enter

from llmaccel.kernels.attention_ref import FP8_E4M3_MAX, is_fp8, reshape_and_cache_ref

__all__ = ["reshape_and_cache", "reshape_and_cache_ref"]

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def _round_to_e4m3_grid(x):
    """fp32 x with |x| <= 448 -> the nearest e4m3 value (ties to even), still in fp32, so the
    cast that follows is exact. Only for Triton's interpreter: its float -> fp8 cast rounds
    ties away from zero and drops mantissa carries (0.1235 came out as 0.0625), while GPUs
    convert with cvt.rn.satfinite. e4m3 has 3 mantissa bits and its subnormals share the spacing
    of the lowest binade (2^-6), so the spacing of x is 2^(max(e, -6) - 3), e = floor(log2|x|)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    spacing = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_spacing = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    units = tl.abs(x) * inv_spacing  # exact (power of two), < 16
    # Adding and removing 1.5 * 2^23 rounds to an integer, ties to even, in fp32 arithmetic.
    units = (units + 12582912.0) - 12582912.0
    mag = units * spacing
    return tl.where(bits < 0, -mag, mag)  # sign from the bits: -0.0 stays -0.0


@triton.jit
def _to_cache(x, inv_scale, dtype, FP8: tl.constexpr, SOFT_ROUND: tl.constexpr):
    if FP8:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
        if SOFT_ROUND:
            x = _round_to_e4m3_grid(x)
        return x.to(dtype, fp_downcast_rounding="rtne")
    return x.to(dtype)


@triton.jit
def _reshape_and_cache_kernel(
    Key, Value, KCache, VCache, Slots, k_inv_scale, v_inv_scale,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    num_kv_heads, head_dim, block_size,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, FP8: tl.constexpr,
    SOFT_ROUND: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
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
    k = _to_cache(k, k_inv_scale, KCache.dtype.element_ty, FP8, SOFT_ROUND)
    v = _to_cache(v, v_inv_scale, VCache.dtype.element_ty, FP8, SOFT_ROUND)
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """key/value [T, kv_heads, d] (head dim contiguous; may be strided views) -> kv_cache
    [2, num_blocks, block_size, kv_heads, d] at slot_mapping [T] (int32/int64, -1 = skip),
    in place. k_scale/v_scale: per-tensor scales of an FP8 cache (ignored otherwise)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and kv_cache.shape[-2:] == (num_kv_heads, head_dim)
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride() == v_cache.stride()
    slot_mapping = slot_mapping.contiguous()
    fp8 = is_fp8(kv_cache.dtype)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, kv_cache.shape[2],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim), FP8=fp8,
        SOFT_ROUND=fp8 and kv_cache.device.type != "cuda",  # the interpreter (see above)
        USE_PDL=pdl.enabled(), num_warps=4, **pdl.launch_kwargs(),
    )
