"""A draft head's overlapped catch-up inputs in one kernel, and the chain's first inputs in a
second (spec/overlap.py, spec/head_proposer.py), each with a PyTorch reference.

Right behind a verify step the next round's drafts are launched from the verify's argmax on
the device. Written as torch ops this took ~35 small kernels per round between the verify
and the head's catch-up graph (the acceptance, the catch-up's ids, positions, slots and
features, the prev-token ids, the context lengths) and ~5 more between the catch-up and the
chain, each a launch from the host: on an H200 the 1.5B's round spent ~0.13 ms of GPU time
and most of its host time there.

`catch_up_inputs`, per sequence i (one program each), from its row of `meta` (the layout
`launch_lookahead` builds: the verify's argmax rows o + min(j, k) for j <= kmax, this round's
draft indexes into the drafts' flat ids for j < kmax, whether draft j exists, the target's KV
slots of positions p..p + k padded to kmax + 1 (where the head's features are), then p, t0,
k):
- a = how many leading drafts equal the target's argmax; the bonus = the argmax after them;
- catch-up row r = i * (kmax + 1) + j: head position p + j with the token at p + j + 1
  (draft j below a, the bonus from a on), its context length p + j + 1, its KV slot through
  its block table where j <= a (else -1: no write), its prev-token id (t0 at j = 0, else
  row r - 1's token) and its feature row (the target's feature at p + j);
- rows[i] = i * (kmax + 1) + a (the row whose output is the next round's first draft) and
  starts[i] = p + a + 1 (where the chain continues).

`chain_inputs` after the catch-up's graph: per sequence, its first draft (the argmax of row
rows[i]), the chain's first feature (that row's output) and its prev-token id (that row's
input id).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: the references run
    triton = None

BLOCK_H = 512


def meta_columns(kmax: int) -> int:
    """Entries per sequence of `meta` for a head's catch-up (see the module docstring)."""
    return 4 * kmax + 5


if triton is not None:
    @triton.jit
    def _catch_up_kernel(greedy, drafts, meta, meta_stride, inputs, in_stride, lens, tables,
                         tab_stride, block_size, prev, feat_src, src_stride, feat_dst,
                         dst_stride, rows_out, starts_out, H, KMAX,
                         WP2: tl.constexpr, HAS_PREV: tl.constexpr, BLOCK: tl.constexpr):
        # KMAX is a runtime argument (one compile per power of two WP2 >= KMAX + 1, not one
        # per k: adaptive k changes it from round to round)
        i = tl.program_id(0).to(tl.int64)
        W = KMAX + 1
        j = tl.arange(0, WP2)
        m = meta + i * meta_stride
        in_w = j < W
        in_k = j < KMAX
        target = tl.load(greedy + tl.load(m + j, mask=in_w, other=0), mask=in_w,
                         other=-1.0).to(tl.int64)
        mine = tl.load(drafts + tl.load(m + W + j, mask=in_k, other=0), mask=in_k,
                       other=-2.0).to(tl.int64)
        ok = (mine == target) & (tl.load(m + W + KMAX + j, mask=in_k, other=0) != 0) & in_k
        a = tl.min(tl.where(ok, KMAX, j), axis=0)  # the first draft that fails (KMAX: none)
        bonus = tl.sum(tl.where(j == a, target, 0), axis=0)
        ids = tl.where(j < a, mine, bonus)
        p = tl.load(m + 4 * KMAX + 2)
        pos = p + j
        write = j <= a
        r = i * W + j
        blk = tl.load(tables + r * tab_stride + pos // block_size, mask=in_w & write,
                      other=0).to(tl.int64)
        tl.store(inputs + r, ids, mask=in_w)
        tl.store(inputs + in_stride + r, pos, mask=in_w)
        tl.store(inputs + 2 * in_stride + r,
                 tl.where(write, blk * block_size + pos % block_size, -1), mask=in_w)
        tl.store(lens + r, (pos + 1).to(tl.int32), mask=in_w)
        if HAS_PREV:  # row j's prev id: row j - 1's token (draft j - 1 below a, else bonus)
            jm = j - 1
            shifted = (j >= 1) & (jm < KMAX)
            mine_prev = tl.load(drafts + tl.load(m + W + jm, mask=shifted, other=0),
                                mask=shifted, other=0.0).to(tl.int64)
            t0 = tl.load(m + 4 * KMAX + 3)
            tl.store(prev + r, tl.where(j == 0, t0, tl.where(jm < a, mine_prev, bonus)),
                     mask=in_w)
        tl.store(rows_out + i, i * W + a)
        tl.store(starts_out + i, p + a + 1)
        cols = tl.arange(0, BLOCK)
        for jj in range(W):  # the target's features of the catch-up's rows
            src = tl.load(m + W + 2 * KMAX + jj)
            for h0 in range(0, H, BLOCK):
                c = h0 + cols
                v = tl.load(feat_src + src * src_stride + c, mask=c < H)
                tl.store(feat_dst + (i * W + jj) * dst_stride + c,
                         v.to(feat_dst.dtype.element_ty), mask=c < H)

    @triton.jit
    def _chain_kernel(greedy, rows, first, out, out_stride, feats, feat_stride, ids, prev, H,
                      HAS_PREV: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        r = tl.load(rows + i)
        tl.store(first + i, tl.load(greedy + r))
        if HAS_PREV:
            tl.store(prev + i, tl.load(ids + r))
        cols = tl.arange(0, BLOCK)
        for h0 in range(0, H, BLOCK):
            c = h0 + cols
            v = tl.load(out + r * out_stride + c, mask=c < H)
            tl.store(feats + i * feat_stride + c, v.to(feats.dtype.element_ty), mask=c < H)


def catch_up_inputs_ref(greedy: torch.Tensor, drafts: torch.Tensor, meta: torch.Tensor,
                        kmax: int, inputs: torch.Tensor, lens: torch.Tensor,
                        tables: torch.Tensor, block_size: int, prev: torch.Tensor | None,
                        feat_src: torch.Tensor, feat_dst: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of `catch_up_inputs`: the same writes with torch ops."""
    n, w = meta.shape[0], kmax + 1
    trow, drow = meta[:, :w], meta[:, w:w + kmax]
    valid = meta[:, w + kmax:w + 2 * kmax].bool()
    slots = meta[:, w + 2 * kmax:2 * w + 2 * kmax]
    p, t0 = meta[:, 4 * kmax + 2], meta[:, 4 * kmax + 3]
    target = greedy.index_select(0, trow.flatten()).view(n, w).long()
    mine = drafts.index_select(0, drow.flatten()).view(n, kmax).long()
    a = ((mine == target[:, :kmax]) & valid).long().cumprod(1).sum(1)
    bonus = target.gather(1, a[:, None])[:, 0]
    j = torch.arange(w, device=meta.device)[None, :]
    ids = torch.where(j < a[:, None], torch.cat([mine, bonus[:, None]], 1), bonus[:, None])
    pos = p[:, None] + j
    r = n * w
    blk = tables[torch.arange(r, device=meta.device), (pos // block_size).flatten()].long()
    inputs[0, :r] = ids.flatten()
    inputs[1, :r] = pos.flatten()
    inputs[2, :r] = torch.where((j <= a[:, None]).flatten(),
                                blk * block_size + pos.flatten() % block_size, -1)
    lens[:r] = (pos + 1).flatten().to(lens.dtype)
    if prev is not None:
        prev[:r] = torch.cat([t0[:, None], ids[:, :-1]], 1).flatten()
    feat_dst[:r] = feat_src.index_select(0, slots.flatten()).to(feat_dst.dtype)
    return torch.arange(0, r, w, device=meta.device) + a, p + a + 1


def catch_up_inputs(greedy: torch.Tensor, drafts: torch.Tensor, meta: torch.Tensor, kmax: int,
                    inputs: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor,
                    block_size: int, prev: torch.Tensor | None, feat_src: torch.Tensor,
                    feat_dst: torch.Tensor, use_kernel: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a head's overlapped catch-up into the graph runner's static buffers (module
    docstring): `greedy` the verify's argmax ids [rows] (float64), `drafts` this round's draft
    ids, flat (float64), `meta` [n, meta_columns(kmax)] int64, `inputs` the runner's int64
    rows (0 ids, 1 positions, 2 slots), `lens` its context lengths, `tables` its block tables
    (rows r already staged), `prev` the head's prev-token ids (None without), `feat_src` the
    target's feature cache, `feat_dst` the head's static features -> (rows [n], starts [n])."""
    if not use_kernel or triton is None:
        return catch_up_inputs_ref(greedy, drafts, meta, kmax, inputs, lens, tables,
                                   block_size, prev, feat_src, feat_dst)
    n = meta.shape[0]
    rows = torch.empty(n, dtype=torch.long, device=meta.device)
    starts = torch.empty(n, dtype=torch.long, device=meta.device)
    h = feat_dst.shape[1]
    _catch_up_kernel[(n,)](
        greedy, drafts, meta, meta.stride(0), inputs, inputs.stride(0), lens, tables,
        tables.stride(0), block_size, inputs if prev is None else prev, feat_src,
        feat_src.stride(0), feat_dst, feat_dst.stride(0), rows, starts, h, kmax,
        WP2=triton.next_power_of_2(kmax + 1), HAS_PREV=prev is not None,
        BLOCK=min(BLOCK_H, triton.next_power_of_2(h)))
    return rows, starts


def warm_up(kmax: int, hidden: int, prev: bool, feat_dtype: torch.dtype,
            device: torch.device) -> None:
    """Compile both kernels for every k up to `kmax` on scratch buffers (they run outside the
    CUDA graphs, so nothing else compiles them before a request's first overlapped round:
    ~2 s of Triton compilation on that round, seen in a first timed W5 run)."""
    if triton is not None and device.type == "cuda":
        run_every_k(kmax, hidden, prev, feat_dtype, device)


def run_every_k(kmax: int, hidden: int, prev: bool, feat_dtype: torch.dtype,
                device: torch.device) -> None:
    """Both kernels once for each k up to `kmax`, on scratch buffers (`warm_up`)."""
    for k in range(1, kmax + 1):
        w = k + 1
        meta = torch.zeros(1, meta_columns(k), dtype=torch.long, device=device)
        inputs = torch.zeros(3, w, dtype=torch.long, device=device)
        lens = torch.zeros(w, dtype=torch.int32, device=device)
        tables = torch.zeros(w, 1, dtype=torch.int32, device=device)
        ids = torch.zeros(w, dtype=torch.long, device=device)
        feats = torch.zeros(w, hidden, dtype=feat_dtype, device=device)
        greedy = torch.zeros(w, dtype=torch.float64, device=device)
        rows, _ = catch_up_inputs(greedy, greedy, meta, k, inputs, lens, tables, 16,
                                  ids if prev else None, feats, feats.clone())
        chain_inputs(greedy, rows, feats, feats.clone(), ids, ids.clone() if prev else None)


def chain_inputs_ref(greedy: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                     feats: torch.Tensor, ids: torch.Tensor, prev: torch.Tensor | None
                     ) -> torch.Tensor:
    """The reference of `chain_inputs`."""
    n = rows.shape[0]
    feats[:n] = out.index_select(0, rows).to(feats.dtype)
    if prev is not None:
        prev[:n] = ids.index_select(0, rows)
    return greedy.index_select(0, rows)


def chain_inputs(greedy: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                 feats: torch.Tensor, ids: torch.Tensor, prev: torch.Tensor | None,
                 use_kernel: bool = True) -> torch.Tensor:
    """After the catch-up: feats[i] = out[rows[i]] (the chain's first features), prev[i] =
    ids[rows[i]] (its prev-token ids) -> greedy[rows] (the first drafts, float64)."""
    if not use_kernel or triton is None:
        return chain_inputs_ref(greedy, rows, out, feats, ids, prev)
    n = rows.shape[0]
    first = torch.empty(n, dtype=greedy.dtype, device=greedy.device)
    h = feats.shape[1]
    _chain_kernel[(n,)](greedy, rows, first, out, out.stride(0), feats, feats.stride(0), ids,
                        ids if prev is None else prev, h, HAS_PREV=prev is not None,
                        BLOCK=min(BLOCK_H, triton.next_power_of_2(h)))
    return first
