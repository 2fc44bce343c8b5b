"""Turns a scheduled step into one flat forward pass and returns the logits to sample from."""

from __future__ import annotations

import torch

from llmaccel.engine.scheduler import SchedulerOutput
from llmaccel.engine.sequence import Sequence
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.transformer import TransformerForCausalLM


class ModelRunner:
    def __init__(self, model: TransformerForCausalLM, kv_caches: list[torch.Tensor],
                 block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = next(model.parameters()).device
        model.bind_kv_caches(kv_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks before a sequence writes into its copy."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor]:
        """Run the step; returns the sequences that reached their last token (and so sample
        now) and their next-token logits [len, vocab]."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables, sampling, rows = [], [], [], [], []
        for seq, n in step.scheduled:
            start = seq.num_computed_tokens
            ids += seq.all_token_ids[start:start + n]
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            if start + n == seq.num_tokens:
                sampling.append(seq)
                rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(query_lens, seq_lens, self.device, slots, tables)
        hidden = self.model(torch.tensor(ids, device=self.device),
                            torch.tensor(positions, device=self.device), meta)
        if not rows:
            return [], hidden.new_empty(0, 0)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return sampling, logits
