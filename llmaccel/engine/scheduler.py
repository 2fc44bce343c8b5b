"""Iteration-level scheduling: every step decides, under a token budget, how many new tokens of
each sequence to compute.

One rule covers prefill, chunked prefill, decode and recompute: a sequence needs
`num_tokens - num_computed_tokens` more tokens computed, and produces a sampled token when a step
brings it to zero. Running sequences go first (FCFS order); then waiting ones are admitted in
arrival order while budget, `max_num_seqs` and KV blocks allow. When a running sequence cannot
get a block, the most recently admitted running sequence is preempted: its blocks are freed and
it goes back to the front of the queue to be recomputed (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmaccel.engine.block_manager import BlockManager
from llmaccel.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: set[str] = set()  # request ids not to admit for now

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            real = seq.num_uncomputed_tokens
            # speculative drafts are computed like any token, after the real ones
            n = min(real + len(seq.spec_token_ids) + len(seq.spec_sibling_ids), budget)
            if seq.spec_sibling_ids and n < real + len(seq.spec_token_ids) + len(
                    seq.spec_sibling_ids):
                seq.spec_sibling_ids = []  # cut by the budget: the chain alone, as it fits
                n = min(real + len(seq.spec_token_ids), budget)
            if not self.enable_chunked_prefill and n < real:
                i += 1
                continue
            while not self.bm.allocate_slots(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                # only verified tokens go into the prefix cache, never drafts
                self.bm.cache_full_blocks(seq, seq.num_computed_tokens + min(n, real))
                if seq.spec_token_ids:
                    seq.spec_token_ids = seq.spec_token_ids[:n - real]  # what the budget left
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: everything after it already went too
        if out.preempted:
            return out  # blocks are short: admit nobody this step
        i = 0  # held requests (FailureIsolation) are passed over, not waited for
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if self.held and seq.request_id in self.held:
                i += 1
                continue
            self.bm.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            fits = self.enable_chunked_prefill or n == seq.num_uncomputed_tokens
            if not (fits and self.bm.allocate_slots(seq, n)):
                self.bm.free(seq)  # hold nothing while waiting
                break  # FCFS: later requests do not jump the queue
            self.bm.cache_full_blocks(seq, seq.num_computed_tokens + n)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                if self.bm.cache is not None:
                    self.bm.cache.record_lookup(len(seq.prompt_token_ids), seq.num_cached_tokens)
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def schedule_decode_ahead(self, seqs: list[Sequence]) -> SchedulerOutput | None:
        """One decode token for each of `seqs` (the whole running set, in order), each already
        holding a placeholder for the token still being computed, or None (nothing allocated)
        if that needs more blocks than are free: the caller then waits and schedules as usual.
        Only blocks of tokens already known are published in the prefix cache: the
        placeholder's block is published by a later step, once its token is real."""
        if seqs != self.running or any(s.num_uncomputed_tokens != 1 for s in seqs):
            return None
        if len(seqs) > self.max_num_batched_tokens:
            return None
        if sum(self.bm.blocks_needed(s, 1) for s in seqs) > self.bm.num_available_blocks:
            return None
        out = SchedulerOutput()
        for seq in seqs:
            ok = self.bm.allocate_slots(seq, 1)
            assert ok, "blocks were counted above"
            self.bm.cache_full_blocks(seq, seq.num_computed_tokens)
            out.scheduled.append((seq, 1))
        return out

    def requeue_running(self) -> list[Sequence]:
        """Send every running sequence back to the front of the queue, in order, holding no
        blocks: each is recomputed when admitted again (after a failed step, whose KV writes
        may not have happened)."""
        seqs, self.running = self.running, []
        for seq in reversed(seqs):
            seq.spec_token_ids, seq.spec_sibling_ids = [], []
            self.bm.free(seq)
            seq.status = SequenceStatus.WAITING
            seq.num_preemptions += 1
            self.waiting.appendleft(seq)
        return seqs

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.spec_token_ids, seq.spec_sibling_ids = [], []
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        # Victims come from the tail, never from what this step already scheduled: those
        # blocks are published in the prefix cache and must be written by this step.
        out.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done or aborted) and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
