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
def _rotary_kernel(
    Positions, X, CosSin, stride_xt, stride_xh, stride_c, num_heads, half,
    HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
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


def _apply(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = x.shape
    assert head_dim % 2 == 0 and x.stride(2) == 1
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, x, cos_sin_cache, x.stride(0), x.stride(1), cos_sin_cache.stride(0),
        num_heads, half,
        HEADS_PAD=triton.next_power_of_2(num_heads), HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int); q [T, heads, d], k [T, kv_heads, d]; cos_sin_cache [max_pos, d]
    fp32 = cat(cos, sin). Rotates q and k IN PLACE and returns them."""
    assert positions.shape[0] == q.shape[0] == k.shape[0]
    positions = positions.contiguous()
    _apply(positions, q, cos_sin_cache)
    _apply(positions, k, cos_sin_cache)
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
