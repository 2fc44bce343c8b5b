"""Triton rotary position embedding (rotate-half / NeoX layout), applied to q and k in place.

One program per token loads cos/sin for its position once and rotates every head of that token
(a [heads, d/2] tile per half), so the cache row is read once per token rather than per head.
The rotary dimension is the full head dim (d even). q and k may be strided views (e.g. slices
of a fused qkv projection) as long as the head dim is contiguous.

Rounding follows `llmaccel.models.layers.rotary.RotaryEmbedding`: the fp32 cos/sin cache is
cast to the input dtype, and each product and the sum are rounded to that dtype, so bf16/fp16
results match the layer. That needs the launches' `enable_fp_fusion=False`: Triton narrows the
math to bf16 and with FP fusion turned x1 * cos - x2 * sin into one FMA, which on an H100 left
17% of bf16 outputs one ulp off the layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.cache import _to_cache, is_fp8
from llmaccel.kernels.pdl import pdl_enter


@triton.jit
def _rope_halves(X, t, pos, CosSin, stride_xt, stride_xh, stride_c, num_heads, half,
                 HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """The rotated halves [HEADS_PAD, HALF_PAD] of token t's heads in X's dtype, with the
    pointer to the first halves and the mask."""
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    j_mask = j < half
    dt = X.dtype.element_ty
    cos = tl.load(CosSin + pos * stride_c + j, mask=j_mask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_c + half + j, mask=j_mask, other=0.0).to(dt).to(tl.float32)
    mask = (h[:, None] < num_heads) & j_mask[None, :]
    p1 = X + t * stride_xt + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    # Round every product as the eager layer does (no-ops for fp32).
    a = (x1 * cos[None, :]).to(dt).to(tl.float32)
    b = (x2 * sin[None, :]).to(dt).to(tl.float32)
    c = (x2 * cos[None, :]).to(dt).to(tl.float32)
    e = (x1 * sin[None, :]).to(dt).to(tl.float32)
    return (a - b).to(dt), (c + e).to(dt), p1, mask


@triton.jit
def _rotate_heads(X, t, pos, CosSin, stride_xt, stride_xh, stride_c, num_heads, half,
                  HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    o1, o2, p1, mask = _rope_halves(X, t, pos, CosSin, stride_xt, stride_xh, stride_c,
                                    num_heads, half, HEADS_PAD, HALF_PAD)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + half, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    Positions, Q, K, CosSin, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    num_q_heads, num_k_heads, half,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Grid (tokens, 2): q and k of a token in one launch (decode is launch-bound).
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_heads(Q, t, pos, CosSin, stride_qt, stride_qh, stride_c, num_q_heads, half,
                      Q_HEADS_PAD, HALF_PAD)
    else:
        _rotate_heads(K, t, pos, CosSin, stride_kt, stride_kh, stride_c, num_k_heads, half,
                      K_HEADS_PAD, HALF_PAD)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int); q [T, heads, d], k [T, kv_heads, d]; cos_sin_cache [max_pos, d]
    fp32 = cat(cos, sin). Rotates q and k IN PLACE and returns them."""
    assert positions.shape[0] == q.shape[0] == k.shape[0]
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[2] == head_dim and head_dim % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    positions = positions.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens, 2)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0), num_q_heads, k.shape[1], half,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(k.shape[1]), HALF_PAD=triton.next_power_of_2(half),
        USE_PDL=pdl.enabled(), num_warps=4, enable_fp_fusion=False, **pdl.launch_kwargs(),
    )
    return q, k


@triton.jit
def _rotary_and_cache_kernel(
    Positions, Q, K, V, CosSin, KCache, VCache, Slots, k_inv_scale, v_inv_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    stride_cb, stride_cs, stride_ch,
    num_q_heads, num_kv_heads, half, block_size,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    FP8: tl.constexpr, SOFT_ROUND: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Grid (tokens, 2): program 0 rotates the token's q heads in place; program 1 rotates its
    # k heads (in place too: prefill attention may read k directly) and writes the rotated k
    # and v into the paged cache, so rope and reshape_and_cache are one launch.
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_heads(Q, t, pos, CosSin, stride_qt, stride_qh, stride_c, num_q_heads, half,
                      Q_HEADS_PAD, HALF_PAD)
    else:
        k1, k2, p1, mask = _rope_halves(K, t, pos, CosSin, stride_kt, stride_kh, stride_c,
                                        num_kv_heads, half, K_HEADS_PAD, HALF_PAD)
        tl.store(p1, k1, mask=mask)
        tl.store(p1 + half, k2, mask=mask)
        slot = tl.load(Slots + t).to(tl.int64)
        h = tl.arange(0, K_HEADS_PAD)
        j = tl.arange(0, HALF_PAD)
        # Slot -1 is padding (CUDA-graph rows): every cache store is masked off.
        cmask = mask & ((h[:, None] * 0 + slot) >= 0)
        dst = ((slot // block_size) * stride_cb + (slot % block_size) * stride_cs
               + h[:, None] * stride_ch + j[None, :])
        kc_dt = KCache.dtype.element_ty
        tl.store(KCache + dst, _to_cache(k1, k_inv_scale, kc_dt, FP8, SOFT_ROUND), mask=cmask)
        tl.store(KCache + dst + half, _to_cache(k2, k_inv_scale, kc_dt, FP8, SOFT_ROUND),
                 mask=cmask)
        pv = V + t * stride_vt + h[:, None] * stride_vh + j[None, :]
        v1 = tl.load(pv, mask=mask, other=0.0)
        v2 = tl.load(pv + half, mask=mask, other=0.0)
        vc_dt = VCache.dtype.element_ty
        tl.store(VCache + dst, _to_cache(v1, v_inv_scale, vc_dt, FP8, SOFT_ROUND), mask=cmask)
        tl.store(VCache + dst + half, _to_cache(v2, v_inv_scale, vc_dt, FP8, SOFT_ROUND),
                 mask=cmask)


def rotary_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding(positions, q, k, ...)` followed by `reshape_and_cache(k, v, ...)` in
    one launch: q and k rotated in place (and returned), rotated k and v written to kv_cache
    [2, num_blocks, block_size, kv_heads, d] at slot_mapping [T] (-1 = skip)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert positions.shape[0] == num_tokens == k.shape[0] == v.shape[0]
    assert v.shape == k.shape and k.shape[2] == head_dim and head_dim % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    assert kv_cache.shape[-2:] == (num_kv_heads, head_dim) and kv_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    fp8 = is_fp8(kv_cache.dtype)
    half = head_dim // 2
    _rotary_and_cache_kernel[(num_tokens, 2)](
        positions.contiguous(), q, k, v, cos_sin_cache, k_cache, v_cache,
        slot_mapping.contiguous(), 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_heads, num_kv_heads, half, kv_cache.shape[2],
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF_PAD=triton.next_power_of_2(half),
        FP8=fp8, SOFT_ROUND=fp8 and kv_cache.device.type != "cuda",  # see kernels/cache.py
        USE_PDL=pdl.enabled(), num_warps=4, enable_fp_fusion=False, **pdl.launch_kwargs(),
    )
    return q, k


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: the exact math of `RotaryEmbedding.forward`, with the same in-place
    contract as `rotary_embedding` (q and k overwritten and returned)."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    return q, k
