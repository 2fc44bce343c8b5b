"""Per-step attention metadata: what the model needs to know about the batch, and nothing more.

The batch is flat: T new tokens from B sequences, sequence i owning rows
query_start_loc[i]:query_start_loc[i+1]. Names follow vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor        # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor               # [B] int32, context length incl. the new tokens
    slot_mapping: torch.Tensor | None    # [T] int64 cache slot of each new token (-1: skip)
    block_tables: torch.Tensor | None    # [B, max_blocks] int32 (-1: unused)
    # Host copies, so reference paths and schedulers never sync with the device to read them.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int = 0
    # None under CUDA-graph capture: a replayed graph must not depend on lengths.
    max_seq_len: int | None = None
    # [B] int64, per row the first position of its sequence this step writes K/V for (the
    # CUDA-graph decode steps set it): the decode attention reads older positions before its
    # PDL wait. None: it reads every position after the wait.
    kv_fresh_from: torch.Tensor | None = None
    # Tree verification (spec/tree.py): each decode row reads its newest key (position
    # seq_len - 1) from its own slot_mapping entry instead of through its block table: a
    # sibling draft's row sits at the position of a chain draft, whose KV the table holds.
    # Identical for every other row (its slot is that table entry); -1 slots read the table.
    newest_key_from_slot: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_pure_decode(self) -> bool:
        """One new token per sequence (the shape CUDA graphs capture)."""
        return self.num_tokens == self.num_seqs

    @property
    def uses_kv_cache(self) -> bool:
        return self.slot_mapping is not None

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token: where next-token logits are taken."""
        return self.query_start_loc[1:].long() - 1

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], device: torch.device | str,
              slot_mapping: list[int] | None = None,
              block_tables: list[list[int]] | None = None) -> AttentionMetadata:
        qsl = [0, *accumulate(query_lens)]
        tables = None
        if block_tables is not None:
            width = max(1, max(len(t) for t in block_tables))
            padded = [t + [-1] * (width - len(t)) for t in block_tables]
            tables = torch.tensor(padded, dtype=torch.int32, device=device)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=(None if slot_mapping is None
                          else torch.tensor(slot_mapping, dtype=torch.int64, device=device)),
            block_tables=tables, query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0))

    @classmethod
    def for_prefill(cls, seq_lens: list[int], device: torch.device | str) -> AttentionMetadata:
        """Whole sequences with no KV cache (scoring, perplexity)."""
        return cls.build(seq_lens, seq_lens, device)
