"""Triton variable-length prefill/extend attention in one launch (flash-attention style).

A flat batch of T new tokens from B sequences; sequence i owns query rows
query_start_loc[i]:query_start_loc[i+1], and its new tokens are its LAST q_len positions, so
query j sits at position seq_len - q_len + j and attends causally to keys 0..that position.

- `paged_prefill_attention` reads every key/value (cached prefix + this step's tokens, already
  written into the cache) through the block table: prefix-cache hits, chunked prefill and mixed
  batches with decode rows (q_len 1) all go through the same kernel.
- `varlen_prefill_attention` is the same kernel without a cache (PAGED=False): k/v are flat
  [T, kv_heads, d] and each sequence attends causally to its own new tokens.

Grid (query blocks, KV heads, sequences). A program's BLOCK_M rows are BLOCK_Q queries times the
GROUP query heads sharing one KV head (GQA packing): each K/V tile is loaded once for the group,
and a decode row fills GROUP rows of the tile instead of one. The query-block count comes from
the host int max_query_len; blocks beyond a sequence's q_len exit at once. Key tiles run in two
phases: tiles wholly below the block's first query need no mask; then the tiles crossing the
diagonal are masked, and tiles wholly above the block's last query are never visited. Heavy
(late) query blocks are launched first so they do not trail at the end of the grid.

Head dims that are not powers of two are padded (to >= 16, for tl.dot) and masked.
An FP8 (e4m3) cache is read as fp8 and cast to the query dtype (exact); k_scale is folded into
the softmax scale and v_scale multiplies the normalised output, so scales cost no per-element work.
References: `attention_ref.paged_attention_ref`, `attention_ref.varlen_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmaccel.kernels.attention_ref import is_fp8

__all__ = ["paged_prefill_attention", "varlen_prefill_attention"]

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv(Base, off, d, p_mask, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A [BLOCK_N, DIM_PAD] K or V tile; masks only where a tile can run out of range."""
    ptrs = Base + off[:, None] + d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, K, V, BlockTables, bt_row, kv_row0, tile, seq_len, row_pos, kv_head,
    d, d_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
    MASKED: tl.constexpr, PAGED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step over keys tile..tile+BLOCK_N-1 for all rows of the block.
    MASKED=False only for tiles wholly below every row's position (all keys valid, visible)."""
    pos = tile + tl.arange(0, BLOCK_N)
    p_mask = pos < seq_len
    if PAGED:
        if MASKED:
            block = tl.load(BlockTables + bt_row + pos // BLOCK_SIZE, mask=p_mask, other=0)
        else:
            block = tl.load(BlockTables + bt_row + pos // BLOCK_SIZE)
        block = block.to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + slot * stride_vs + kv_head * stride_vh
    else:
        row = (kv_row0 + pos).to(tl.int64)
        k_off = row * stride_kb + kv_head * stride_kh
        v_off = row * stride_vb + kv_head * stride_vh
    k = _load_kv(K, k_off, d, p_mask, d_mask, MASKED, EVEN_D).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * qk_scale
    if MASKED:
        visible = p_mask[None, :] & (pos[None, :] <= row_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    # Every row sees at least one key of the first tile it visits (see the kernel), so m_new
    # is finite and no -inf - -inf arises.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv(V, v_off, d, p_mask, d_mask, MASKED, EVEN_D).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, BlockTables, QueryStartLoc, SeqLens, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)  # late (heavy) query blocks first
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    q0 = q_block * BLOCK_Q
    if q0 >= q_len:
        return
    if PAGED:
        seq_len = tl.load(SeqLens + seq)
    else:
        seq_len = q_len
    prefix = seq_len - q_len

    # Row r of the tile: query q0 + r // GROUP, head r % GROUP of this KV head's group.
    r = tl.arange(0, BLOCK_M)
    q_idx = q0 + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    row_pos = prefix + q_idx
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    q_off = (q_start + q_idx).to(tl.int64) * stride_qt + heads * stride_qh
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + q_off[:, None] + d[None, :], mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    bt_row = seq.to(tl.int64) * stride_bt
    # Keys below the block's first query position are visible to every row: no mask.
    full_end = (prefix + q0) // BLOCK_N * BLOCK_N
    # One past the last key the block's last query sees; later tiles are skipped outright.
    kv_end = tl.minimum(seq_len, prefix + q0 + BLOCK_Q)
    for tile in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, K, V, BlockTables, bt_row, q_start, tile, seq_len, row_pos,
            kv_head, d, d_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, qk_scale, False, PAGED, EVEN_D, BLOCK_SIZE, BLOCK_N, PRECISION)
    # The first diagonal tile starts at or below prefix + q0 <= every row's position, so each
    # row (padding rows included: their positions are larger) has a visible key there.
    for tile in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, K, V, BlockTables, bt_row, q_start, tile, seq_len, row_pos,
            kv_head, d, d_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, qk_scale, True, PAGED, EVEN_D, BLOCK_SIZE, BLOCK_N, PRECISION)
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * v_scale  # the cache holds V / v_scale
    o_off = (q_start + q_idx).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(Out + o_off[:, None] + d[None, :], out.to(Out.dtype.element_ty), mask=io_mask)


# GPU tiles by head dim: (largest DIM_PAD, BLOCK_M, BLOCK_N, num_warps). Chosen, untimed, so that
# sm_90 builds do not spill registers: K/V tiles are gathered through the block table with a
# 64-bit pointer per element, which costs more registers than block-pointer flash attention.
# fp32 (correctness runs, not a speed target) needs about twice the registers: smaller tiles.
_TILES_16BIT = ((64, 128, 64, 8), (128, 64, 32, 8), (256, 32, 32, 8))
_TILES_32BIT = ((64, 32, 16, 4), (256, 16, 16, 4))


def _tile_config(group: int, dim_pad: int, max_query_len: int, on_gpu: bool,
                 fp32: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). BLOCK_M shrinks to what the longest query needs
    (decode-heavy batches), then with fewer warps and a key tile small enough not to spill; it
    always holds one whole GQA group. The Triton interpreter (no GPU) gets small tiles, so small
    test cases still cross several key tiles and both key phases."""
    if not on_gpu:
        full_m, block_n, warps = 32, 16, 4
    else:
        table = _TILES_32BIT if fp32 else _TILES_16BIT
        full_m, block_n, warps = next((t[1:] for t in table if dim_pad <= t[0]), table[-1][1:])
    need = max(16, triton.next_power_of_2(group * max(1, max_query_len)))
    block_m = max(min(full_m, need), triton.next_power_of_2(group))
    if block_m >= full_m:
        return block_m, block_n, warps
    return block_m, min(block_n, 32 if dim_pad <= 128 else 16), 4


def _launch(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            block_tables: torch.Tensor | None, query_start_loc: torch.Tensor,
            seq_lens: torch.Tensor | None, scale: float, max_query_len: int,
            paged: bool, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Shared host side. key/value: cache halves [num_blocks, block_size, kv_heads, d] when
    paged, else flat [T, kv_heads, d]. k_scale/v_scale: scales of an FP8 cache."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key.shape[-2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1, \
        "head dim must be contiguous"
    out = torch.empty_like(q)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, warps = _tile_config(group, dim_pad, max_query_len,
                                             q.device.type == "cuda", q.dtype == torch.float32)
    block_q = block_m // group
    if paged:
        block_size = key.shape[1]
        k_strides = (key.stride(0), key.stride(1), key.stride(2))
        v_strides = (value.stride(0), value.stride(1), value.stride(2))
        bt_stride = block_tables.stride(0)
    else:
        # Flat rows act as "blocks" of one token: block = row, slot stride unused.
        block_size = 1
        k_strides = (key.stride(0), 0, key.stride(1))
        v_strides = (value.stride(0), 0, value.stride(1))
        block_tables, seq_lens, bt_stride = query_start_loc, query_start_loc, 0  # never read
    kv_fp8 = is_fp8(key.dtype)
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, num_seqs)
    _prefill_kernel[grid](
        q, key, value, out, block_tables, query_start_loc, seq_lens,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0), v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_strides, *v_strides,
        bt_stride,
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, EVEN_D=head_dim == dim_pad,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size, PAGED=paged,
        # fp32 models get full-precision dots (the default would round inputs to TF32).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=kv_fp8,
        num_warps=warps,
    )
    return out


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            max_query_len: int, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """q [T, H, d] flat new tokens; kv_cache [2, num_blocks, block_size, kv_heads, d] already
    holding this step's K/V; block_tables [B, max_blocks] int32 (-1 pads); query_start_loc
    [B+1] int32; seq_lens [B] int32 (context incl. the new tokens); max_query_len: host int
    >= every q_len (sets the grid) -> [T, H, d]. k_scale/v_scale: per-tensor scales of an FP8
    cache (ignored otherwise)."""
    return _launch(q, kv_cache[0], kv_cache[1], block_tables, query_start_loc, seq_lens, scale,
                   max_query_len, paged=True, k_scale=k_scale, v_scale=v_scale)


def varlen_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             query_start_loc: torch.Tensor, scale: float,
                             max_query_len: int) -> torch.Tensor:
    """Prefill without a cache: q [T, H, d], k/v [T, kv_heads, d] flat (strided views fine, head
    dim contiguous); each sequence attends causally to its own tokens -> [T, H, d]."""
    return _launch(q, k, v, None, query_start_loc, None, scale, max_query_len, paged=False)
