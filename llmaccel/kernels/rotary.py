"""Triton rotary position embedding (rotate-half / NeoX layout), applied to q and k in place.

One program per token loads cos/sin for its position once and rotates every head of that token
(a [heads, d/2] tile per half), so the cache row is read once per token rather than per head.
The rotary dimension is the full head dim (d even). q and k may be strided views (e.g. slices
of a fused qkv projection) as long as the head dim is contiguous.

Rounding follows `llmaccel.models.layers.rotary.RotaryEmbedding`: the fp32 cos/sin cache is
cast to the input dtype, and each product and the sum are rounded to that dtype, so bf16/fp16
results match the layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, t, pos, CosSin, stride_xt, stride_xh, stride_c, num_heads, half,
                  HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
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
    tl.store(p1, (a - b).to(dt), mask=mask)
    tl.store(p1 + half, (c + e).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    Positions, Q, K, CosSin, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    num_q_heads, num_k_heads, half,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    # Grid (tokens, 2): q and k of a token in one launch (decode is launch-bound).
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
        num_warps=4,
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
