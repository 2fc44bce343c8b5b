"""Triton paged decode attention: one new token per sequence against its paged KV cache.

One program per (sequence, KV head, split) handles the whole GQA group of query heads that share
the KV head, so each K/V tile is read once for the group: decode is memory-bound and K/V reads
are the cost. Online softmax over tiles of BLOCK_N cached tokens (gathered through the block
table), in the exp2 domain.

Split-K (flash-decoding): with few sequences, (sequence, KV head) programs leave most SMs idle, so
the context is cut into `num_splits` contiguous ranges, each program writing a normalised partial
output and its log-sum-exp into a workspace; a second small kernel merges the splits. The range of
a split is computed inside the kernel from the seq_len it loads, so the launch grid depends only
on (num_seqs, num_kv_heads, num_splits): a CUDA graph captured once replays for any lengths.
num_splits == 1 is the single-pass path (no workspace, no second kernel).

Head dims that are not powers of two (e.g. 24, 80) are padded to the next power of two (at least
16, for tl.dot) and masked. Reference: `attention_ref.paged_decode_attention_ref`.

Under PDL the kernel reads the step inputs (context length, block ids) before its wait, and,
given `kv_fresh_from` (the CUDA-graph decode steps), the first tile's K/V that earlier steps
wrote: the K/V load then overlaps the qkv projection instead of following it. Only positions at
or past kv_fresh_from (this step's tokens, written by the kernel just before) wait.

FP8 (e4m3) caches: tiles are loaded as fp8 (half the bytes of bf16, which is the point) and cast
to the query dtype, which holds every e4m3 value exactly. The per-tensor scales cost nothing per
element: k_scale is folded into the softmax scale, v_scale multiplies the normalised output.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.pdl import pdl_enter

from llmaccel.kernels.attention_ref import is_fp8

__all__ = ["choose_num_splits", "paged_decode_attention"]

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
# A split shorter than this costs more in its extra K/V tile loop, workspace traffic and the
# combine pass than the parallelism it adds.
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _attend_tile(q, k, v, p_mask, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One tile of the online softmax: scores of q against the tile's keys k (masked by
    p_mask), the running max m_i and sum l_i rescaled, p @ v added to acc."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * qk_scale
    s = tl.where(p_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    Q, K, V, BlockTables, SeqLens, KvFresh, LastSlots, Out, PartOut, PartLse, Counters,
    qk_scale, v_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr, FUSED_COMBINE: tl.constexpr, SPLITS_PAD: tl.constexpr,
    EARLY_KV: tl.constexpr, LAST_FROM_SLOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the PDL wait: the sequence's length and its first tile's block ids. They are step
    # inputs, staged before the step's first layer, so at least two launches back, which a
    # PDL kernel may read before its wait (see kernels/pdl.py); q and the K/V cache are not
    # (the kernel before this one writes the new tokens' K/V). This takes two dependent
    # loads off the path after the wait.
    seq_len = tl.load(SeqLens + seq)
    if LAST_FROM_SLOT:
        # Tree verification (spec/tree.py): the row's newest key, at position seq_len - 1, is
        # the one it wrote itself (its slot, a step input like the length), not the one its
        # block table holds there (a sibling draft shares its position with a chain draft).
        # A row without a slot (-1: padding) reads through its table.
        last_slot = tl.load(LastSlots + seq)
        last_pos = tl.where(last_slot >= 0, seq_len - 1, -1)
        last_off = ((last_slot // BLOCK_SIZE) * stride_kb + (last_slot % BLOCK_SIZE) * stride_ks
                    + kv_head * stride_kh)
    # Whole tiles per split, so every split but the last starts and ends on a tile boundary.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    pos = start + tl.arange(0, BLOCK_N)
    block = tl.load(BlockTables + seq * stride_bt + pos // BLOCK_SIZE, mask=pos < end, other=0)
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    if EARLY_KV:
        # The first tile's cached K/V too, where earlier steps wrote it: positions below
        # KvFresh[seq] (a step input: the first position this step writes in the row's
        # sequence). Those were written by an earlier graph replay, so they are final before
        # this kernel starts; the rest (this step's tokens, written by the kernel just before
        # this one) are loaded after the wait. A decode row's HBM latency then overlaps the
        # qkv projection instead of following it.
        fresh = tl.load(KvFresh + seq).to(tl.int32)
        offs0 = (block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks
                 + kv_head * stride_kh)
        if LAST_FROM_SLOT:
            offs0 = tl.where(pos == last_pos, last_off, offs0)
        old = (pos < end) & (pos < fresh)
        # in q's dtype at once (an FP8 cache's values are exact in it), so the merge with
        # the rows loaded after the wait selects between 16/32-bit values
        q_dtype = Q.dtype.element_ty
        k0 = tl.load(K + offs0[:, None] + d[None, :], mask=old[:, None] & d_mask[None, :],
                     other=0.0).to(q_dtype)
        v0 = tl.load(V + offs0[:, None] + d[None, :], mask=old[:, None] & d_mask[None, :],
                     other=0.0).to(q_dtype)
        block = tl.load(BlockTables + seq * stride_bt + (pos + BLOCK_N) // BLOCK_SIZE,
                        mask=pos + BLOCK_N < end, other=0)
    pdl_enter(USE_PDL)

    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    q = tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    first = start
    if EARLY_KV:
        if start < end:
            new = (pos < end) & (pos >= fresh)
            new_mask = new[:, None] & d_mask[None, :]
            k0 = tl.where(new_mask, tl.load(K + offs0[:, None] + d[None, :], mask=new_mask,
                                            other=0.0).to(q.dtype), k0)
            v0 = tl.where(new_mask, tl.load(V + offs0[:, None] + d[None, :], mask=new_mask,
                                            other=0.0).to(q.dtype), v0)
            m_i, l_i, acc = _attend_tile(q, k0, v0, pos < end, m_i, l_i, acc, qk_scale,
                                         PRECISION)
        first = start + BLOCK_N
    # An empty range (first >= end: a short sequence with many splits) runs no iterations.
    for tile in range(first, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        offs = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        if LAST_FROM_SLOT:
            offs = tl.where(pos == last_pos, last_off, offs)
        # the next tile's block ids, loaded while this tile computes
        block = tl.load(BlockTables + seq * stride_bt + (pos + BLOCK_N) // BLOCK_SIZE,
                        mask=pos + BLOCK_N < end, other=0)
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(K + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(V + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        m_i, l_i, acc = _attend_tile(q, k, v, p_mask, m_i, l_i, acc, qk_scale, PRECISION)
    # l_i >= 1 whenever a key was seen; 0 only for an empty range (or seq_len 0): output 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * v_scale  # the cache holds V / v_scale (a split's share scales the same way)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        # Base-2 log-sum-exp of the scaled scores; -inf marks an empty split (l_i is 0 there
        # and >= 1 otherwise, so the max only keeps log2 away from 0).
        lse = m_i + tl.log2(tl.maximum(l_i, 1.0))
        part = PartOut + seq * stride_pt + heads[:, None] * stride_ph + split * stride_ps
        tl.store(part + d[None, :], out, mask=out_mask)
        tl.store(PartLse + seq * stride_lt + heads * stride_lh + split, lse, mask=g_mask)
        if FUSED_COMBINE:
            # The last split of this (sequence, KV head) to finish merges them all: one
            # kernel instead of two. Every thread's stores precede the barrier; one release
            # atomic then publishes them at GPU scope, and the last program's acquire (then a
            # barrier) orders its loads after every split's stores (CUTLASS's semaphore
            # pattern). The counter goes back to 0 for the next call.
            tl.debug_barrier()
            counter = Counters + seq * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_SPLITS - 1:
                tl.debug_barrier()
                _merge_group(PartOut, PartLse, Out, seq, heads, g_mask, stride_pt, stride_ph,
                             stride_ps, stride_lt, stride_lh, stride_ot, stride_oh, HEAD_DIM,
                             DIM_PAD, NUM_SPLITS, SPLITS_PAD)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_group(PartOut, PartLse, Out, seq, heads, g_mask, stride_pt, stride_ph, stride_ps,
                 stride_lt, stride_lh, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                 DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """`_combine_splits_kernel` for the query heads `heads` of one KV head, inside the decode
    kernel: the splits' outputs weighted by exp2(lse - max), through L2 (.cg: other programs
    wrote them)."""
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(PartLse + seq * stride_lt + heads[:, None] * stride_lh + s[None, :],
                  mask=g_mask[:, None] & s_mask[None, :], other=float("-inf"),
                  cache_modifier=".cg")
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: no -inf - -inf
    w = tl.exp2(lse - m[:, None])
    total = tl.sum(w, 1)
    part = tl.load(PartOut + seq * stride_pt + heads[:, None, None] * stride_ph
                   + s[None, :, None] * stride_ps + d[None, None, :],
                   mask=g_mask[:, None, None] & s_mask[None, :, None] & d_mask[None, None, :],
                   other=0.0, cache_modifier=".cg")
    out = tl.sum(part * w[:, :, None], 1) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(Out + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine_splits_kernel(
    PartOut, PartLse, Out,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(PartLse + seq * stride_lt + head * stride_lh + s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    # All splits empty (seq_len 0, e.g. a padded CUDA-graph row): avoid -inf - -inf = NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    part = tl.load(PartOut + seq * stride_pt + head * stride_ph + s[:, None] * stride_ps
                   + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + seq * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty),
             mask=d_mask)


# The last split of a (sequence, KV head) merges the splits in the decode kernel itself (the
# separate combine kernel remains for calls without counters). The decode kernel reads the
# step's context lengths and block tables before its PDL wait (H100 W1 on the 3B shape: bf16
# decode 362.5 against 359.5 tok/s, TTFT 4.02 against 4.25 ms), and with `kv_fresh_from` (the
# CUDA-graph decode steps pass it) also its first tile's K/V from earlier steps.
# Arrival counters of the fused combine, one int32 per (sequence, KV head), per KV cache (so
# two models' attention, e.g. a draft's on another stream, never share one). Zeroed once
# outside graph capture; each call leaves them at 0 again.
_counters: dict[tuple[int, int], torch.Tensor] = {}


def _combine_counters(kv_cache: torch.Tensor, n: int) -> torch.Tensor | None:
    """Counters for n (sequence, KV head) pairs, or None when they would have to be allocated
    (or grown) under CUDA-graph capture (then the separate combine kernel runs)."""
    key = (kv_cache.device.index or 0, kv_cache.data_ptr())
    c = _counters.get(key)
    if c is not None and c.numel() >= n:
        return c
    if kv_cache.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    _counters[key] = c = torch.zeros(max(n, 1024), dtype=torch.int32, device=kv_cache.device)
    return c


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def splits_for(programs: int, num_sms: int, max_seq_len_hint: int | None = None) -> int:
    """The split-K heuristic on plain numbers (see `choose_num_splits`)."""
    target = 2 * num_sms
    if programs <= 0 or programs >= target:
        return 1
    splits = min(MAX_SPLITS, -(-target // programs))
    if max_seq_len_hint is not None:
        splits = min(splits, max(1, max_seq_len_hint // MIN_TOKENS_PER_SPLIT))
    return max(1, splits)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len_hint: int | None = None,
                      device: torch.device | str | None = None) -> int:
    """Splits per (sequence, KV head) for `paged_decode_attention`.

    Aim for about two programs per SM (so one wave hides the other's memory latency):
    splits = ceil(2 * SMs / (num_seqs * num_kv_heads)), capped at MAX_SPLITS (16). Batches that
    already give >= 2 programs per SM get 1 (single pass, no combine). With a length hint (the
    batch's longest context) each split keeps at least MIN_TOKENS_PER_SPLIT (256) tokens, so
    short contexts are not split. Pass no hint under CUDA-graph capture: the result, and so the
    grid, must not depend on lengths. Non-CUDA devices (the Triton interpreter) get 1: splitting
    only adds work there.
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return splits_for(num_seqs * num_kv_heads, _sm_count(index), max_seq_len_hint)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                           block_n: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0,
                           kv_fresh_from: torch.Tensor | None = None,
                           last_slots: torch.Tensor | None = None,
                           _fused_combine: bool = True) -> torch.Tensor:
    """q [B, H, d]; kv_cache [2, num_blocks, block_size, kv_heads, d]; block_tables
    [B, max_blocks] int32; seq_lens [B] int32 -> [B, H, d].

    num_splits None picks `choose_num_splits(B, kv_heads, device=q.device)` (no length hint, so
    graph-safe); 1 is the single-pass kernel. A sequence with seq_len 0 gets zeros. block_n:
    cached tokens per tile (None: 32; 16 for fp32 q, whose wider tiles spill registers; 128, or
    64 with splits, for an fp8 cache).
    k_scale/v_scale: per-tensor scales of an FP8 cache (ignored otherwise).
    kv_fresh_from [B] (int32/int64, on q's device): row b's K/V at positions below
    kv_fresh_from[b] were written before the kernel launched just before this one (earlier
    steps), so under PDL they are read before the wait; None: every K/V read waits.
    last_slots [B] int64 (tree verification, spec/tree.py): row b reads its newest key
    (position seq_lens[b] - 1) from cache slot last_slots[b] instead of through its block
    table, where that is >= 0 (the slot the row wrote; -1: through the table)."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and kv_cache.stride(-1) == 1, "head dim must be contiguous"
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, device=q.device)
    num_splits = max(1, int(num_splits))
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    key, value = kv_cache[0], kv_cache[1]
    kv_fp8 = is_fp8(kv_cache.dtype)
    if kv_fresh_from is not None and (
            kv_fresh_from.shape != (num_seqs,) or kv_fresh_from.device != q.device
            or kv_fresh_from.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"kv_fresh_from must be [{num_seqs}] int32/int64 on {q.device}, got "
                         f"{tuple(kv_fresh_from.shape)} {kv_fresh_from.dtype} on "
                         f"{kv_fresh_from.device}")
    early_kv = kv_fresh_from is not None
    if last_slots is not None and (last_slots.shape != (num_seqs,)
                                   or last_slots.device != q.device
                                   or last_slots.dtype != torch.int64):
        raise ValueError(f"last_slots must be [{num_seqs}] int64 on {q.device}, got "
                         f"{tuple(last_slots.shape)} {last_slots.dtype} on {last_slots.device}")
    # tl.dot needs every dimension >= 16.
    group_pad = max(16, triton.next_power_of_2(group))
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:
        if q.dtype == torch.float32:
            block_n = 16
        elif kv_fp8:
            # fp8 tiles carry half the bytes: longer ones keep as many loads in flight. H100,
            # bf16 q, d 64/128: 128 was fastest single-pass (1.2-1.6x bf16), 64 with splits.
            block_n = 128 if num_splits == 1 else 64
        else:
            block_n = 32
    block_n = max(16, triton.next_power_of_2(block_n))
    counters = None
    if num_splits == 1:
        # Never read: the single-pass kernel stores straight into `out`.
        part_out, part_lse = out, out
        part_strides = (0, 0, 0, 0, 0)
    else:
        if _fused_combine:  # False: the separate combine kernel (its test compares them)
            counters = _combine_counters(kv_cache, num_seqs * num_kv_heads)
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)
        part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key, value, block_tables, seq_lens, kv_fresh_from if early_kv else seq_lens,
        last_slots if last_slots is not None else seq_lens, out, part_out, part_lse,
        counters if counters is not None else seq_lens,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0), v_scale,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *part_strides,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        # fp32 models get full-precision dots (the default would round inputs to TF32).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=kv_fp8,
        USE_PDL=pdl.enabled(), FUSED_COMBINE=counters is not None,
        SPLITS_PAD=triton.next_power_of_2(num_splits), EARLY_KV=early_kv, LAST_FROM_SLOT=last_slots is not None, **pdl.launch_kwargs(),
    )
    if num_splits > 1 and counters is None:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, *part_strides, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), USE_PDL=pdl.enabled(),
            **pdl.launch_kwargs(),
        )
    return out
