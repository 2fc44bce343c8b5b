"""Triton paged decode attention: one new token per sequence against its paged KV cache.

One program per (sequence, KV head) handles the whole GQA group of query heads that share the
KV head, so each K/V tile is read once for the group: decode is memory-bound and K/V reads are
the cost. Online softmax over tiles of BLOCK_N cached tokens (gathered through the block
table). Reference: `attention_ref.paged_decode_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    Q, K, V, BlockTables, SeqLens, Out, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(SeqLens + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    q = tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < seq_len
        block = tl.load(BlockTables + seq * stride_bt + pos // BLOCK_SIZE, mask=p_mask, other=0)
        offs = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(K + offs[:, None] + d[None, :], mask=p_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offs[:, None] + d[None, :], mask=p_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                             input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=g_mask[:, None])


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           block_n: int = 32) -> torch.Tensor:
    """q [B, H, d]; kv_cache [2, num_blocks, block_size, kv_heads, d]; block_tables
    [B, max_blocks] int32; seq_lens [B] int32 -> [B, H, d]."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    key, value = kv_cache[0], kv_cache[1]
    # tl.dot needs every dimension >= 16.
    group_pad = max(16, triton.next_power_of_2(group))
    block_n = max(16, block_n)
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, key, value, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        # fp32 models get full-precision dots (the default would round inputs to TF32).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
