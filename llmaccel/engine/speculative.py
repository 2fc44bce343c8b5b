"""Speculative decoding inside the engine's step: drafts before scheduling, verification after.

A decoding sequence carries its drafts in `seq.spec_token_ids`. The scheduler counts them as
extra tokens to compute (so the token budget, KV blocks and preemption treat them like any
other token, and only verified tokens are published in the prefix cache); the runner appends
them to the sequence's input and returns logits for its last real token and every draft. After
the step, the verifier (spec/verifier.py) decides what is emitted; the rejected drafts' KV slots
are rolled back by lowering `num_computed_tokens` and dropping the blocks past the sequence's
end from its table (no KV is copied: later tokens overwrite the stale slots).

Sequences that ask for logprobs or still have banned tokens (min_tokens) decode without drafts,
as does every sequence of a step with more running requests than `disable_by_batch_size`.
"""

from __future__ import annotations

import time

import torch

from llmaccel.engine.block_manager import BlockManager
from llmaccel.engine.sequence import Sequence
from llmaccel.spec.adaptive import AcceptanceTracker
from llmaccel.spec.config import SpeculativeConfig, SpeculativeConfigError
from llmaccel.spec.metrics import SpecDecodeStats
from llmaccel.spec.ngram import NgramProposer
from llmaccel.spec.verifier import VerifyResult, greedy_verify, processed_probs, rejection_sample

# Cost of one more token in a verify step relative to a decode step, for the adaptive k of the
# n-gram proposer, which has no draft model to time: small on a GPU at low batch (decode is
# memory-bound), not zero. `SpeculativeConfig.draft_cost_ratio` overrides it.
NGRAM_COST_RATIO = 0.05


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, stop_checker) -> None:
        if config.method != "ngram":
            raise SpeculativeConfigError(
                f"speculative method {config.method!r} is not available in the engine yet; "
                "use method='ngram'")
        self.config = config
        self.max_model_len = max_model_len
        self.stop_checker = stop_checker
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.cost_ratio = (config.draft_cost_ratio if config.draft_cost_ratio is not None
                           else NGRAM_COST_RATIO)
        self.stats = SpecDecodeStats()

    # -- before scheduling ---------------------------------------------------------------------
    def _eligible(self, seq: Sequence) -> bool:
        return (not seq.is_finished and seq.num_uncomputed_tokens == 1
                and seq.params.logprobs is None and not self.stop_checker.banned_tokens(seq))

    def _k(self, seq: Sequence) -> int:
        k = self.config.num_speculative_tokens
        if self.config.adaptive:
            if seq.spec_tracker is None:
                seq.spec_tracker = AcceptanceTracker()
            k = seq.spec_tracker.next_k(self.cost_ratio, k)
        # Never draft past the context or max_tokens: one token is emitted besides the drafts.
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return max(0, min(k, room))

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's drafts for the next step (empty where it does not
        speculate)."""
        start = time.perf_counter()
        on = self.config.speculate_at(len(running))
        for seq in running:
            seq.spec_token_ids = []
            if on and self._eligible(seq):
                k = self._k(seq)
                if k:
                    seq.spec_token_ids = self.proposer.propose([seq.all_token_ids], [k])[0]
        self.stats.draft_time_s += time.perf_counter() - start

    # -- after the step ------------------------------------------------------------------------
    def verify(self, seqs: list[Sequence], logits: torch.Tensor, offsets: list[int]
               ) -> tuple[VerifyResult, list[list[float]]]:
        """Verify each sequence's drafts against its k + 1 logits rows starting at offsets[i];
        returns the result and the emitted tokens' logprobs under the model's distribution."""
        start = time.perf_counter()
        kmax = max(len(s.spec_token_ids) for s in seqs)
        idx = torch.tensor([[o + min(j, len(s.spec_token_ids)) for j in range(kmax + 1)]
                            for s, o in zip(seqs, offsets)], device=logits.device)
        target = logits[idx]  # [B, kmax + 1, V]; rows past a sequence's drafts repeat its last
        drafts = torch.tensor([s.spec_token_ids + [-1] * (kmax - len(s.spec_token_ids))
                               for s in seqs], device=logits.device)
        num = torch.tensor([len(s.spec_token_ids) for s in seqs], device=logits.device)
        if all(s.params.greedy for s in seqs):
            result = greedy_verify(drafts, target, num)
        else:
            probs = processed_probs(target, [s.params for s in seqs])
            result = rejection_sample(drafts, None, probs, num, [s.generator for s in seqs])
        emitted = torch.tensor([t + [0] * (kmax + 1 - len(t)) for t in result.tokens],
                               device=logits.device)
        lp = target.float().log_softmax(-1).gather(-1, emitted[..., None]).squeeze(-1)
        logprobs = [row[:len(t)] for row, t in zip(lp.tolist(), result.tokens)]
        self.stats.verify_time_s += time.perf_counter() - start
        return result, logprobs

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        """Book a verified step: the rejected drafts leave the computed tokens (the caller
        appends the emitted tokens, with its stop checks, then calls `rollback_blocks`)."""
        k = len(seq.spec_token_ids)
        seq.num_computed_tokens -= k - num_accepted
        seq.spec_token_ids = []
        self.stats.observe(k, num_accepted)
        seq.spec_stats.observe(k, num_accepted)
        if seq.spec_tracker is not None:
            seq.spec_tracker.observe(k, num_accepted)

    def rollback_blocks(self, seq: Sequence, block_manager: BlockManager) -> None:
        """Drop table entries past what the sequence's tokens need (allocated for rejected
        drafts); a new list, as the CUDA-graph runner expects of a changed table."""
        keep = -(-seq.num_tokens // block_manager.block_size)
        if len(seq.block_table) > keep:
            block_manager.truncate(seq, keep)
