"""FlexAttention backend: one `flex_attention` call per layer over the whole flat batch.

The flat batch (T new tokens from B sequences) is attended as a single packed "document":
queries are the T new tokens, keys are every sequence's full context packed one sequence
after another, and a BlockMask says which (query, key) pairs may meet:

    same sequence  AND  key position <= query's absolute position

where query j of sequence i sits at absolute position seq_len_i - q_len_i + j (its new tokens
are its last q_len positions). Without a cache the keys are the new tokens themselves, which
makes this plain causal attention within each sequence.

Cost: FlexAttention wants K/V as one dense [1, kv_heads, total_kv, d] tensor, so each step
copies every sequence's whole context out of the paged cache (one gather per layer, of
sum(seq_lens) tokens). Decode steps, which read their context once, pay that copy on top of
the attention itself. This backend is the portable option (any device FlexAttention runs
on, any head dim >= 16 on CUDA); the Triton backend reads the paged cache in place and avoids
the gather. Rows of one 128-query block may come from different sequences, so a decode
batch's block is dense over all of those sequences' keys: compute grows with batch size times
total context (the mask discards the cross terms, but they are computed).

Per step, the index tensors, gather slots and BlockMask depend only on the metadata, so they
are built once (on the first layer) and reused by the other layers.

An FP8 (e4m3) cache is gathered as bytes and cast to the query dtype (exact) before the call:
FlexAttention itself sees ordinary tensors; k_scale joins the softmax scale and v_scale
multiplies the output.

Compilation: on CUDA `flex_attention` goes through one module-level `torch.compile` (dynamic
shapes, so new batch shapes do not recompile), which generates the fused block-sparse Triton
kernel. On CPU it runs eagerly: in torch 2.13 the compiled CPU path works for a fixed shape but
its C++ template fails to build once the KV length is symbolic ("cur_kvSplitSize8 was not
declared"), and compiling per static shape costs seconds per new shape. Eager FlexAttention
materializes the [H, T, total_kv] float32 score matrix, so on CPU this backend is for
correctness checks, not speed (the `torch` backend is the CPU default).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from llmaccel.errors import LLMAccelError
from llmaccel.kernels.attention_ref import is_fp8, reshape_and_cache_ref
from llmaccel.models.attention.backend import AttentionBackend
from llmaccel.models.attention.metadata import AttentionMetadata

# The compiled Triton template needs tl.dot, which needs an embedding dim of at least 16
# (inductor raises "NYI: embedding dimension ... must be at least 16" deep inside compilation);
# head dims that are not powers of two (e.g. 24) are padded by the template and are fine.
MIN_COMPILED_HEAD_DIM = 16


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """One compiled flex_attention for the process, shared by every layer and backend
    instance, so a model compiles once per head config and dtype; dynamic=True keeps new
    batch shapes (T, total_kv) from recompiling beyond dynamo's 0/1 specializations."""
    return torch.compile(flex_attention, dynamic=True, fullgraph=True)


def _eager_flex_attention(*args, **kwargs) -> torch.Tensor:
    # Eager is chosen on purpose (see the module docstring); the "call me compiled" warning
    # would only mislead users of the CPU path.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


@dataclass
class _StepPlan:
    """What every layer of one step shares: built from the metadata alone."""

    meta: AttentionMetadata   # identity key: the runner builds a new metadata object per step
    paged: bool
    num_rows: int
    block_size: int
    kv_slots: torch.Tensor | None   # [total_kv] int64 cache slot of each packed key (paged)
    block_mask: BlockMask

    def matches(self, meta: AttentionMetadata, paged: bool, num_rows: int,
                block_size: int) -> bool:
        return (self.meta is meta and self.paged == paged and self.num_rows == num_rows
                and self.block_size == block_size)


def _build_plan(meta: AttentionMetadata, paged: bool, num_rows: int, block_size: int,
                device: torch.device) -> _StepPlan:
    """Per-token sequence ids and absolute positions for queries and packed keys, all on
    `device` from the metadata's device tensors (no host sync: sizes come from host copies)."""
    qsl = meta.query_start_loc.to(device=device, dtype=torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    if paged:
        kv_lens = meta.seq_lens.to(device=device, dtype=torch.int64)
        total_kv = sum(meta.seq_lens_cpu)
    else:  # keys are the new tokens themselves
        kv_lens = q_lens
        total_kv = meta.num_tokens
    num_seqs = meta.num_seqs
    seq_ids = torch.arange(num_seqs, device=device)

    # Queries: rows past the last sequence (padding, if a caller pads T) get id num_seqs, which
    # no key has, so they attend to nothing (FlexAttention returns zeros for such rows).
    rows = torch.arange(num_rows, device=device)
    q_seq = torch.searchsorted(qsl[1:], rows, right=True)
    q_seq_safe = q_seq.clamp_max(num_seqs - 1)
    q_pos = rows - qsl[q_seq_safe] + (kv_lens - q_lens)[q_seq_safe]

    # Keys: sequence i's context packed at kv_start[i] .. kv_start[i] + kv_len[i] - 1.
    kv_seq = torch.repeat_interleave(seq_ids, kv_lens, output_size=total_kv)
    kv_start = torch.cumsum(kv_lens, 0) - kv_lens
    kv_pos = torch.arange(total_kv, device=device) - kv_start[kv_seq]

    kv_slots = None
    if paged:
        blocks = meta.block_tables[kv_seq, kv_pos // block_size].long()
        kv_slots = blocks * block_size + kv_pos % block_size

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_seq[q_idx] == kv_seq[kv_idx]) & (kv_pos[kv_idx] <= q_pos[q_idx])

    # B=None, H=None: one mask broadcast over the (single) batch and all heads.
    block_mask = create_block_mask(mask_mod, None, None, num_rows, total_kv, device=device)
    return _StepPlan(meta, paged, num_rows, block_size, kv_slots, block_mask)


class FlexAttentionBackend(AttentionBackend):
    """PyTorch FlexAttention over K/V gathered from the paged cache (see module docstring).

    `compiled=False` runs eager FlexAttention on CUDA too (debugging, or to compare eager
    with compiled output); CPU always runs eagerly."""

    name = "flex"
    # The BlockMask is rebuilt from host-side lengths every step: nothing a graph could replay.
    supports_cuda_graphs = False

    def __init__(self, compiled: bool = True) -> None:
        self.compiled = compiled
        self._plan: _StepPlan | None = None

    def attention_fn(self, device_type: str, head_dim: int) -> Callable[..., torch.Tensor]:
        """The flex_attention to call: compiled on CUDA (unless compiled=False), else eager.
        Raises LLMAccelError for a head dim the compiled kernel cannot take."""
        if not (self.compiled and device_type == "cuda"):
            return _eager_flex_attention
        if head_dim < MIN_COMPILED_HEAD_DIM:
            raise LLMAccelError(
                f"attention backend 'flex' does not support head_dim {head_dim} on CUDA "
                f"(compiled FlexAttention needs >= {MIN_COMPILED_HEAD_DIM}); use "
                "--attention-backend triton or torch")
        return _compiled_flex_attention()

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
        if kv_cache.device.type == "cuda":
            from llmaccel.kernels import triton_available, triton_supports_fp8
            if triton_available() and (not is_fp8(kv_cache.dtype)
                                       or triton_supports_fp8(kv_cache.device)):
                from llmaccel.kernels.cache import reshape_and_cache
                reshape_and_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)
                return
        reshape_and_cache_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        if meta.newest_key_from_slot:
            raise ValueError("attention backend 'flex' does not run tree verification rows "
                             "(use the triton or torch backend)")
        num_rows = q.shape[0]
        if num_rows == 0 or meta.num_seqs == 0:
            return torch.zeros_like(q)
        attend = self.attention_fn(q.device.type, q.shape[-1])
        paged = kv_cache is not None and meta.uses_kv_cache
        block_size = kv_cache.shape[2] if paged else 0
        if self._plan is None or not self._plan.matches(meta, paged, num_rows, block_size):
            self._plan = _build_plan(meta, paged, num_rows, block_size, q.device)
        plan = self._plan

        out_scale = 1.0
        if paged:
            self._write_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
            # One gather for K and V together: [2, total_kv, kv_heads, d] (the copy the
            # module docstring talks about).
            flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
            if is_fp8(kv_cache.dtype):
                # Gathered as bytes (torch's float8 indexing is patchy across devices), cast
                # exactly to q's dtype; k_scale joins the softmax scale, v_scale the output.
                kv = flat.view(torch.uint8).index_select(1, plan.kv_slots)
                kv = kv.view(kv_cache.dtype).to(q.dtype)
                scale, out_scale = scale * k_scale, v_scale
            else:
                kv = flat.index_select(1, plan.kv_slots).to(q.dtype)
            keys, values = kv[0], kv[1]
        else:
            keys, values = k.to(q.dtype), v.to(q.dtype)

        # [T, H, d] -> [1, H, T, d] views; flex only needs the head dim contiguous.
        out = attend(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                     values.transpose(0, 1).unsqueeze(0), block_mask=plan.block_mask,
                     scale=scale, enable_gqa=True)
        if out_scale != 1.0:
            out = out * out_scale
        return out[0].transpose(0, 1).contiguous()
