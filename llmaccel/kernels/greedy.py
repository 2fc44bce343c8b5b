"""Triton greedy sampling: argmax and its logprob (logit - logsumexp) over the vocabulary in
two small launches, for the decode graph; and a chained draft step's pick (`greedy_ids_into`):
the argmax mapped through a draft vocabulary's ids and written where the chain wants it.

torch's one-row reductions over a 128k vocabulary run in one thread block each (~25 us for
argmax or logsumexp at batch 1). Here each program reduces one chunk of one row (max, first
argmax, sum of exp against the chunk max) and a second kernel merges a row's chunks, so every
SM helps at batch 1. Reference: `llmaccel.kernels.greedy_select.greedy_with_logprobs` (torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.pdl import pdl_enter


@triton.jit
def _chunk_kernel(Logits, Max, Arg, Sum, stride_l, vocab, num_chunks,
                  CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row * stride_l + idx, mask=idx < vocab,
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    a = tl.argmax(x, 0, tie_break_left=True) + c * CHUNK
    s = tl.sum(tl.exp(x - m), 0)
    out = row * num_chunks + c
    tl.store(Max + out, m)
    tl.store(Arg + out, a)
    tl.store(Sum + out, s)


@triton.jit
def _merge_kernel(Max, Arg, Sum, Out, num_chunks, num_rows, CHUNKS_PAD: tl.constexpr,
                  USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    mask = c < num_chunks
    m = tl.load(Max + row * num_chunks + c, mask=mask, other=float("-inf"))
    s = tl.load(Sum + row * num_chunks + c, mask=mask, other=0.0)
    big = tl.max(m, 0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), 0))
    # The first chunk holding the maximum: chunks are in vocabulary order, so this is
    # torch.argmax's first-occurrence rule.
    best = tl.argmax(m, 0, tie_break_left=True)
    token = tl.load(Arg + row * num_chunks + best)
    tl.store(Out + row, token.to(tl.float64))
    tl.store(Out + num_rows + row, (big - lse).to(tl.float64))


@triton.jit
def _merge_ids_kernel(Max, Arg, Ids, OutF, OutI, num_chunks, CHUNKS_PAD: tl.constexpr,
                      HAS_IDS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    m = tl.load(Max + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    token = tl.load(Arg + row * num_chunks + tl.argmax(m, 0, tie_break_left=True))
    if HAS_IDS:  # a draft vocabulary's column -> its token id
        token = tl.load(Ids + token)
    tl.store(OutF + row, token.to(tl.float64))
    tl.store(OutI + row, token.to(tl.int64))


def _chunk_pass(logits: torch.Tensor, chunk: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The first launch of both pairs: per row and chunk, the max, its first argmax and the
    sum of exp against it -> (maxes, args, sums [rows, chunks], chunks). rows > 0."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    chunk = min(chunk, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    dev = logits.device
    maxes = torch.empty(rows, num_chunks, dtype=torch.float32, device=dev)
    args = torch.empty(rows, num_chunks, dtype=torch.int64, device=dev)
    sums = torch.empty(rows, num_chunks, dtype=torch.float32, device=dev)
    _chunk_kernel[(rows, num_chunks)](logits, maxes, args, sums, logits.stride(0), vocab,
                                      num_chunks, CHUNK=chunk, USE_PDL=pdl.enabled(),
                                      num_warps=8, **pdl.launch_kwargs())
    return maxes, args, sums, num_chunks


def greedy_ids_into(logits: torch.Tensor, ids: torch.Tensor | None, out_f64: torch.Tensor,
                    out_i64: torch.Tensor, chunk: int = 4096) -> None:
    """A chained draft step's tokens in two launches: each row's argmax over `logits` [B, V]
    (first occurrence), mapped through `ids` [V] (a draft vocabulary's token ids) where given,
    into out_f64 [B] (float64: the chain's output) and out_i64 [B] (int64: the next step's
    input ids). Replaces the merge, the id lookup, two conversions and two copies."""
    assert out_f64.is_contiguous() and out_i64.is_contiguous()
    rows = logits.shape[0]
    if rows == 0:
        return
    maxes, args, _, num_chunks = _chunk_pass(logits, chunk)
    _merge_ids_kernel[(rows,)](maxes, args, args if ids is None else ids, out_f64, out_i64,
                               num_chunks, CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)),
                               HAS_IDS=ids is not None, USE_PDL=pdl.enabled(),
                               **pdl.launch_kwargs())


def greedy_sample(logits: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """logits [B, vocab] (any float dtype, last dim contiguous) -> [2, B] float64: argmax ids
    and their logprobs, as `greedy_with_logprobs`."""
    rows = logits.shape[0]
    out = torch.empty(2, rows, dtype=torch.float64, device=logits.device)
    if rows == 0:
        return out
    maxes, args, sums, num_chunks = _chunk_pass(logits, chunk)
    _merge_kernel[(rows,)](maxes, args, sums, out, num_chunks, rows,
                           CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)),
                           USE_PDL=pdl.enabled(), **pdl.launch_kwargs())
    return out
