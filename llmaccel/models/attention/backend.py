"""Attention backends: the one seam through which the model reaches attention kernels."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from llmaccel.kernels.attention_ref import (paged_attention_ref, paged_decode_attention_ref,
                                            reshape_and_cache_ref, varlen_attention_ref)
from llmaccel.models.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q [T, H, d], k/v [T, kv_heads, d] -> [T, H, d]; writes k/v into kv_cache first."""


class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch, one sequence at a time: the CPU path and the reference for kernels."""

    name = "torch"

    def forward(self, q, k, v, kv_cache, meta, scale):
        if kv_cache is None or not meta.uses_kv_cache:
            return varlen_attention_ref(q, k, v, meta.query_start_loc_cpu, scale)
        reshape_and_cache_ref(k, v, kv_cache, meta.slot_mapping)
        if meta.num_tokens == meta.num_seqs:  # pure decode: one padded call, no Python loop
            return paged_decode_attention_ref(q, kv_cache, meta.block_tables, meta.seq_lens,
                                              scale)
        return paged_attention_ref(q, kv_cache, meta.block_tables, meta.query_start_loc_cpu,
                                   meta.seq_lens_cpu, scale)


_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    if name not in _BACKENDS:
        from llmaccel.errors import LLMAccelError
        raise LLMAccelError(f"unknown attention backend '{name}' "
                            f"(available: {', '.join(_BACKENDS)})")
    return _BACKENDS[name]()
