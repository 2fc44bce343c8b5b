"""Attention backends: the one seam through which the model reaches attention kernels.

- `torch`: plain PyTorch references; the CPU path and what every kernel is tested against.
- `triton`: our Triton kernels (paged decode with split-K; varlen prefill/extend reading the
  paged cache); capturable in CUDA graphs for decode. Default on CUDA.
- `flex`: PyTorch FlexAttention over K/V gathered from the paged cache; portable, not graphed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from llmaccel.kernels import triton_available
from llmaccel.kernels.attention_ref import (paged_attention_ref, paged_decode_attention_ref,
                                            reshape_and_cache_ref, varlen_attention_ref)
from llmaccel.models.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    # Decode steps may be captured in CUDA graphs: forward never reads device values on the
    # host, and launch shapes depend only on the batch size.
    supports_cuda_graphs: bool = False

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """q [T, H, d], k/v [T, kv_heads, d] -> [T, H, d]; writes k/v into kv_cache first.
        An FP8 kv_cache (float8_e4m3fn) stores k / k_scale and v / v_scale (see
        kernels/attention_ref.py); other cache dtypes ignore the scales."""

    def forward_with_rope(self, positions: torch.Tensor, rotary_emb, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                          meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> torch.Tensor:
        """Rotary embedding on q and k, then `forward`. A backend may fuse the two."""
        q, k = rotary_emb(positions, q, k)
        return self.forward(q, k, v, kv_cache, meta, scale, k_scale, v_scale)


class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch, one sequence at a time: the CPU path and the reference for kernels."""

    name = "torch"

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        if kv_cache is None or not meta.uses_kv_cache:
            return varlen_attention_ref(q, k, v, meta.query_start_loc_cpu, scale)
        reshape_and_cache_ref(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        if meta.is_pure_decode:  # one padded call, no Python loop
            return paged_decode_attention_ref(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale, k_scale, v_scale,
                meta.slot_mapping if meta.newest_key_from_slot else None)
        _check_no_tree(meta, self.name)
        return paged_attention_ref(q, kv_cache, meta.block_tables, meta.query_start_loc_cpu,
                                   meta.seq_lens_cpu, scale, k_scale, v_scale)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels: K/V written by one kernel, then decode (GQA group per program, split-K
    over long contexts) or varlen prefill/extend that reads cached prefixes in one launch."""

    name = "triton"
    supports_cuda_graphs = True
    # Rope and the K/V cache write in one kernel (kernels/rotary.py) when the layer's rotary
    # runs on Triton; TransformerForCausalLM.set_fused_kernels(fuse_decode=False) turns it
    # off with the other decode fusions.
    fuse_rope_cache = True

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        from llmaccel.kernels import prefill_attention as pf
        from llmaccel.kernels.cache import reshape_and_cache
        if kv_cache is None or not meta.uses_kv_cache:
            return pf.varlen_prefill_attention(q, k, v, meta.query_start_loc, scale,
                                               meta.max_query_len)
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        return self.attend_cached(q, kv_cache, meta, scale, k_scale, v_scale)

    def forward_with_rope(self, positions, rotary_emb, q, k, v, kv_cache, meta, scale,
                          k_scale=1.0, v_scale=1.0):
        if not (self.fuse_rope_cache and rotary_emb.use_triton and kv_cache is not None
                and meta.uses_kv_cache):
            return super().forward_with_rope(positions, rotary_emb, q, k, v, kv_cache, meta,
                                             scale, k_scale, v_scale)
        from llmaccel.kernels.rotary import rotary_and_cache
        rotary_and_cache(positions, q, k, v, rotary_emb.cos_sin_cache, kv_cache,
                         meta.slot_mapping, k_scale, v_scale)
        return self.attend_cached(q, kv_cache, meta, scale, k_scale, v_scale)

    def attend_cached(self, q, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        """Attention of q over the paged cache, which already holds this step's K/V."""
        from llmaccel.kernels import prefill_attention as pf
        from llmaccel.kernels.paged_attention import choose_num_splits, paged_decode_attention
        if meta.is_pure_decode:
            splits = choose_num_splits(meta.num_seqs, kv_cache.shape[3], meta.max_seq_len,
                                       q.device)
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                          num_splits=splits, k_scale=k_scale, v_scale=v_scale,
                                          kv_fresh_from=meta.kv_fresh_from,
                                          last_slots=(meta.slot_mapping
                                                      if meta.newest_key_from_slot else None))
        _check_no_tree(meta, self.name)
        return pf.paged_prefill_attention(q, kv_cache, meta.block_tables, meta.query_start_loc,
                                          meta.seq_lens, scale, meta.max_query_len,
                                          k_scale=k_scale, v_scale=v_scale)


def _check_no_tree(meta: AttentionMetadata, backend: str) -> None:
    """Tree verification runs as decode rows only (one token per row)."""
    if meta.newest_key_from_slot:
        raise ValueError(f"attention backend {backend!r}: tree verification rows "
                         "(newest_key_from_slot) must be decode rows, one token each")


def _flex() -> type[AttentionBackend]:
    from llmaccel.models.attention.flex import FlexAttentionBackend
    return FlexAttentionBackend


_BACKENDS = {"torch": lambda: TorchAttentionBackend, "triton": lambda: TritonAttentionBackend,
             "flex": _flex}
BACKEND_NAMES = ("auto", *_BACKENDS)


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """'auto' -> triton on CUDA when Triton is installed, else torch (CPU, or no Triton)."""
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    return name


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    from llmaccel.errors import LLMAccelError
    if name not in _BACKENDS:
        raise LLMAccelError(f"unknown attention backend '{name}' "
                            f"(available: {', '.join(BACKEND_NAMES)})")
    if name == "triton" and not triton_available():
        raise LLMAccelError(f"attention backend '{name}' needs Triton: pip install triton "
                            "(Linux), or use --attention-backend torch")
    return _BACKENDS[name]()()
