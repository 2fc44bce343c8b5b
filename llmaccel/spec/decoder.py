"""Speculative decoding inside the engine's step: drafts before scheduling, verification after.

A decoding sequence carries its drafts in `seq.spec_token_ids`. The scheduler counts them as
extra tokens to compute (so the token budget, KV blocks and preemption treat them like any
other token, and only verified tokens are published in the prefix cache); the runner appends
them to the sequence's input and returns logits for its last real token and every draft. After
the step, the verifier (spec/verifier.py) decides what is emitted; the rejected drafts' KV slots
are rolled back by lowering `num_computed_tokens` and dropping the blocks past the sequence's
end from its table (no KV is copied: later tokens overwrite the stale slots).

Sequences that ask for logprobs or still have banned tokens (min_tokens) decode without drafts,
as does every sequence of a step with `disable_by_batch_size` running requests or more (and
no speculative work is done for such steps: no n-gram indexing, no switch measurement), or,
below that, when the step costs were measured (spec/costs.py) and `auto_disable` is on, of a
step at a batch size where speculating was measured slower than plain decoding or, before
that, where the step costs make it cost more than the engine's recent acceptance rate pays
back (the automatic switch, spec/switch.py). Such steps run as plain decoding, async
scheduling included (`off`).
"""

from __future__ import annotations

import time

import torch

from llmaccel.engine.block_manager import BlockManager
from llmaccel.kernels.greedy_select import greedy_with_logprobs
from llmaccel.engine.sequence import Sequence
from llmaccel.spec.adaptive import AcceptanceTracker, best_k
from llmaccel.spec.config import SpeculativeConfig, SpeculativeConfigError
from llmaccel.spec.costs import StepCosts, constant_cost_fn
from llmaccel.spec.draft_model import DeviceDrafts
from llmaccel.spec.metrics import SpecDecodeStats
from llmaccel.spec.ngram import NgramIndex
from llmaccel.spec.overlap import (Lookahead, launch_next_round, set_pending_siblings,
                                   use_lookahead)
from llmaccel.spec.switch import ShadowAcceptance, SpecSwitch, StepKind
from llmaccel.spec.tree import greedy_verify_tree, sibling_depth
from llmaccel.spec.verifier import greedy_verify_rows, processed_probs, rejection_sample

# Cost of one more token in a verify step relative to a decode step, for the adaptive k of the
# n-gram proposer, which has no draft model to time: small on a GPU at low batch (decode is
# memory-bound), not zero. `SpeculativeConfig.draft_cost_ratio` overrides it.
NGRAM_COST_RATIO = 0.05
# A draft model's step relative to the target's, for the adaptive k until measured: a 3x
# smaller model runs a decode step in about a third of the time or more (launch-bound).
DRAFT_COST_RATIO = 0.35
# A draft head's step (one layer, plus the target's LM head) relative to the target's: a
# fraction of a draft model's, above n-gram's; measured at run time where graphs exist.
HEAD_COST_RATIO = 0.15
# n-gram indexes are kept current while the GPU runs a step (index_running), a 1/INDEX_SPREAD
# share of the running sequences per step, round robin: each sequence catches up every
# INDEX_SPREAD steps on what it decoded since, and the host work per step stays small (one
# call per sequence costs more than the few tokens it adds).
INDEX_SPREAD = 8


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, stop_checker,
                 draft=None) -> None:
        """`draft`: the DraftModelProposer (spec/draft_model.py) for method 'draft', the
        HeadProposer (spec/head_proposer.py) for 'head'."""
        if config.method != "ngram" and draft is None:
            raise SpeculativeConfigError(f"speculative method {config.method!r} needs its "
                                         "proposer (the engine loads it)")
        self.config = config
        self.max_model_len = max_model_len
        self.stop_checker = stop_checker
        self.draft = draft
        default_cost = (NGRAM_COST_RATIO if draft is None else
                        HEAD_COST_RATIO if config.method == "head" else DRAFT_COST_RATIO)
        self.cost_ratio = (config.draft_cost_ratio if config.draft_cost_ratio is not None
                           else default_cost)
        # The engine's recent acceptance over all requests, for the cost model's on/off answer
        # before speculation is measured (decays slowly: it sees every request's step).
        self.batch_tracker = AcceptanceTracker(decay=0.98)
        # The automatic off switch (spec/switch.py), once the engine measured its step costs
        # (a GPU with CUDA graphs: `costs`); None: the constant model 1 + k * cost_ratio.
        self.switch: SpecSwitch | None = None
        self.off = False  # the last round left speculation off for the whole batch
        # the last round was at or above disable_by_batch_size (running + waiting); the steps
        # launched ahead after it run the same batch, so they are not measured either
        self._limited = False
        self._capped = False  # this round's drafts were cut short by max_tokens / the context
        # This round's draft-model proposals still on the device (spec/draft_model.py): the
        # verify step reads them there; `complete` brings them to the host.
        self.pending: DeviceDrafts | None = None
        # The next round's drafts, launched with this round's verify step (spec/overlap.py).
        self.lookahead: Lookahead | None = None
        self.num_overlapped = 0  # rounds whose drafts were launched during the previous one
        self.num_overlap_dropped = 0  # such drafts dropped (the running set changed, ...)
        self.num_ngram_first = 0  # sequence rounds drafted by lookup under ngram_first
        self.num_tree_accepted = 0  # sequence rounds that accepted a sibling (spec/tree.py)
        # tree verification: the engine's ModelRunner.move_slots (an accepted sibling's KV to
        # its position's slot)
        self.move_slots = None
        self.tree_picks: list[int] | None = None  # the last verify's accepted siblings
        self._index_cursor = 0  # index_running: where the next share of sequences starts
        self.stats = SpecDecodeStats()

    @property
    def costs(self) -> StepCosts | None:
        """Measured step costs (set by the engine on a GPU with CUDA graphs)."""
        return None if self.switch is None else self.switch.costs

    @costs.setter
    def costs(self, costs: StepCosts | None) -> None:
        shadow = ShadowAcceptance() if self.draft is None else None
        self.switch = None if costs is None else SpecSwitch(costs, self._prior, shadow)

    def _cost(self, batch: int):
        """Relative step cost as a function of k at this batch size."""
        if self.costs is not None and self.config.draft_cost_ratio is None:
            return self.costs.cost_fn(batch)
        return constant_cost_fn(self.cost_ratio)

    def _prior(self, batch: int) -> bool:
        """The cost model's choice before speculation is measured at a batch size: whether
        any k pays at the engine's recent acceptance."""
        return best_k(self.batch_tracker.alpha, self._cost(batch),
                      self.config.num_speculative_tokens) > 0

    @property
    def automatic(self) -> bool:
        """Whether the switch decides per step below disable_by_batch_size (measured costs,
        auto_disable)."""
        return self.config.auto_disable and self.switch is not None

    def _switched(self, batch: int) -> bool:
        """Whether the automatic switch decides a round of `batch` running requests (not at
        or above disable_by_batch_size, where rounds are plain and nothing is measured)."""
        return self.automatic and self.config.speculate_at(batch)

    @property
    def monitor(self):
        """The switch's measured rates (spec/costs.ThroughputMonitor)."""
        return None if self.switch is None else self.switch.monitor

    def speculate_at(self, batch: int, round_index: int | None = None) -> bool:
        """Whether a round with `batch` running requests speculates: never at or above
        disable_by_batch_size; below it, as the automatic switch decides where there is one
        (spec/switch.py; its probes run the other mode now and then; `round_index`: default
        the next round), else always."""
        if not self._switched(batch):
            return self.config.speculate_at(batch)
        return self.switch.decide(batch, round_index)[0]

    def may_launch_ahead(self, batch: int) -> bool:
        """Whether the next step may be launched ahead as plain decoding (async scheduling):
        the last round did not speculate and the next one would not either."""
        return self.off and not self.speculate_at(batch)

    def skip_round(self, batch: int) -> None:
        """A plain step launched ahead: a round without a proposal."""
        if self._switched(batch):
            self.switch.next_round(batch, self.switch.decide(batch)[1])
        self.stats.num_off_steps += 1

    def step_kind(self, sched) -> StepKind | None:
        """The kind of a step to measure: every sequence decodes (one real token plus its
        drafts, no prefill chunk); None for other steps, and for speculative steps whose
        drafts were cut short by max_tokens or the context (the last rounds of a batch: they
        emit fewer tokens than speculation does, and their low rate would stand for the
        batch size in later requests)."""
        if not self.automatic or self._limited or not sched.scheduled:
            return None
        drafted = False
        rows = 0
        for seq, n in sched.scheduled:
            if n != 1 + len(seq.spec_token_ids) + len(seq.spec_sibling_ids):
                return None
            drafted = drafted or bool(seq.spec_token_ids)
            rows += n
        if drafted and self._capped:
            return None
        return StepKind(len(sched.scheduled), drafted, rows)

    def record_step(self, kind: StepKind | None, tokens: int, seconds: float,
                    steady: bool = True) -> None:
        """One step's measurement for the automatic switch (SpecSwitch.record_step)."""
        if self.switch is not None:
            self.switch.record_step(kind, tokens, seconds, steady)

    # -- before scheduling ---------------------------------------------------------------------
    def _eligible(self, seq: Sequence) -> bool:
        return (not seq.is_finished and seq.num_uncomputed_tokens == 1
                and seq.params.logprobs is None and not self.stop_checker.bans_any(seq))

    def _room(self, seq: Sequence, ahead: int = 0) -> int:
        """How many drafts fit before the context or max_tokens ends (one token is emitted
        besides the drafts), `ahead` tokens from now."""
        room = self.max_model_len - seq.num_tokens - ahead - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - ahead - 1)
        return room

    def _wanted_k(self, seq: Sequence, cost, memo: dict[float, int] | None = None) -> int:
        """The k the sequence's recent acceptance asks for (the configured k without adaptive
        speculation). `memo`: the round's answers by acceptance (to three decimals) for its
        one cost function: best_k per sequence was ~6 us of a ~20 us proposal per sequence
        on a CPU, at batch 64 a spec round's host time."""
        k = self.config.num_speculative_tokens
        if self.config.adaptive:
            if seq.spec_tracker is None:
                seq.spec_tracker = AcceptanceTracker()
            memo = {} if memo is None else memo
            alpha = round(seq.spec_tracker.alpha, 3)
            best = memo.get(alpha)
            if best is None:  # as AcceptanceTracker.next_k: at least 1, to keep probing
                best = memo[alpha] = max(1, best_k(alpha, cost, k))
            k = best
        return k

    def _k(self, seq: Sequence, cost, memo: dict[float, int] | None = None) -> int:
        """The sequence's k this round: as wanted, never past the context or max_tokens."""
        room = self._room(seq)
        self._capped = self._capped or room < self.config.num_speculative_tokens
        return max(0, min(self._wanted_k(seq, cost, memo), room))

    def propose(self, running: list[Sequence], waiting: int = 0) -> None:
        """Set each running sequence's drafts for the next step (empty where it does not
        speculate). `waiting`: requests waiting for admission, which count towards
        disable_by_batch_size as in vLLM (the batch they are about to join is that large)."""
        start = time.perf_counter()
        self.pending = None
        self._capped = False
        lookahead, self.lookahead = self.lookahead, None
        batch = len(running)
        # at or above disable_by_batch_size: no switch round, and its steps are not measured
        self._limited = not self.config.speculate_at(batch + waiting)
        if self._limited:
            on = False
        elif running and self.automatic:
            on, chosen = self.switch.decide(batch)
            self.switch.next_round(batch, chosen)
            if on and self.switch.shadow is not None:
                self.switch.shadow.clear()  # measured rounds say more than past samples
        else:
            on = self.speculate_at(batch)
        self.off = not on
        self.stats.num_off_steps += bool(running) and not on
        if (lookahead is not None and on and self.config.ngram_first
                and any(self._lookup_hit(seq) for seq in running if self._eligible(seq))):
            # ngram_first: lookup drafts where it finds a match, so the head's (or draft
            # model's) drafts launched during the last round are not used this round
            lookahead.revert(self.draft)
            self.num_overlap_dropped += 1
            lookahead = None
        if lookahead is not None and use_lookahead(self, lookahead, running, on):
            self.stats.draft_time_s += time.perf_counter() - start
            return  # drafted during the last round (spec/overlap.py)
        cost = self._cost(batch)
        memo: dict[float, int] = {}
        drafting, ks = [], []
        for seq in running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            seq.spec_sibling_ids = []
            if on and self._eligible(seq):
                k = self._k(seq, cost, memo)
                if k:
                    drafting.append(seq)
                    ks.append(k)
        if self.draft is None:
            for seq, k in zip(drafting, ks):
                seq.spec_token_ids = self._ngram_index(seq).propose(seq, k)
        elif self.config.ngram_first:
            drafting, ks = self._ngram_first(drafting, ks)
        if self.draft is not None and drafting:
            drafts, qs, self.pending = self.draft.propose(
                drafting, ks, self.config.draft_confidence_threshold, keep_on_device=True)
            for seq, d, q in zip(drafting, drafts, qs):
                seq.spec_token_ids, seq.spec_draft_probs = d, q
            set_pending_siblings(drafting, self.pending)
        self.stats.draft_time_s += time.perf_counter() - start

    def _ngram_first(self, seqs: list[Sequence], ks: list[int]
                     ) -> tuple[list[Sequence], list[int]]:
        """ngram_first: drafts from n-gram lookup where it finds a match (up to
        prompt_lookup_num_tokens, else the sequence's k); returns the sequences (and their k)
        left for the draft model or head."""
        most = self.config.prompt_lookup_num_tokens
        rest, rest_ks = [], []
        for seq, k in zip(seqs, ks):
            k_lookup = self._lookup_k(seq, k)
            drafts = self._ngram_index(seq).propose(seq, k_lookup) if k_lookup > 0 else []
            if drafts:
                seq.spec_token_ids = drafts
                self.num_ngram_first += 1
                # a lookup cut short by the context or max_tokens: not a steady round
                self._capped = self._capped or (most is not None and k_lookup < most)
            else:
                rest.append(seq)
                rest_ks.append(k)
        return rest, rest_ks

    def _lookup_k(self, seq: Sequence, k: int) -> int:
        """The most tokens an ngram_first lookup drafts for `seq` whose model k is `k`:
        prompt_lookup_num_tokens cut by the room left (max_tokens, the context), else k."""
        most = self.config.prompt_lookup_num_tokens
        return k if most is None else min(most, self._room(seq))

    def _lookup_hit(self, seq: Sequence) -> bool:
        """Whether an ngram_first lookup finds a match for `seq` now (its drafts are what
        `_ngram_first` takes this round)."""
        k = self._lookup_k(seq, min(self.config.num_speculative_tokens, self._room(seq)))
        return k > 0 and bool(self._ngram_index(seq).propose(seq, k))

    def _ngram_index(self, seq: Sequence) -> NgramIndex:
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.config.prompt_lookup_min,
                                         self.config.prompt_lookup_max)
        return seq.ngram_index

    def index_running(self, running: list[Sequence], waiting: int = 0) -> None:
        """Called while the GPU runs a step: bring a share of the running sequences' n-gram
        indexes up to date, so the next speculative round (a probe after plain rounds, the
        first round after a prefill) only indexes the tokens of the last few steps. Without
        this, a probe at batch 64 indexed every prompt and all tokens decoded since, ~10-20
        ms of host time before its verify step on an H100 host (a
        step trace: 10.3 ms idle before each such verify): a probe cost several
        plain steps. Indexing stops at a sequence's next-to-last token (NgramIndex.update),
        so a placeholder for a token still being computed is never read.

        While speculation is off (automatic switch), each such update first takes a shadow
        sample (NgramIndex.shadow): what lookup would have drafted where the index stood, and
        how much of it the tokens decoded since confirm, for the switch's prediction of a
        speculative round (spec/switch.py). A sequence that never speculates (logprobs)
        counts as a round of one token."""
        if ((self.draft is not None and not self.config.ngram_first) or not running
                or not self.config.speculate_at(len(running) + waiting)):
            return  # at or above disable_by_batch_size: catches up below it (propose)
        shadow = None if self.switch is None or not self.off else self.switch.shadow
        n = len(running)
        start = self._index_cursor if self._index_cursor < n else 0
        end = min(n, start + -(-n // INDEX_SPREAD))
        k = self.config.num_speculative_tokens
        for seq in running[start:end]:
            if seq.is_finished:
                continue
            index = self._ngram_index(seq)
            if shadow is None:
                index.update(seq)
            elif seq.params.logprobs is not None:
                index.update(seq)
                shadow.observe(0, 0, n)
            else:
                sample = index.shadow(seq, k)
                if sample is not None:
                    shadow.observe(*sample, n)
        self._index_cursor = end

    def overlap(self, sampling: list[Sequence], logits: torch.Tensor,
                greedy: torch.Tensor | None, rows_per_seq: list[int],
                running: list[Sequence], waiting: int = 0, copy_to_host=None):
        """Called right after a verify step is launched: launch the next round's drafts now
        (spec/overlap.py `launch_next_round`, which says where it does); returns the verify
        step's greedy rows copied to the host where it did (`complete` reads them there),
        else None."""
        start = time.perf_counter()
        self.lookahead, host = launch_next_round(self, sampling, logits, greedy, rows_per_seq,
                                                 running, waiting, copy_to_host)
        self.stats.draft_time_s += time.perf_counter() - start
        return host

    def device_drafts(self) -> tuple[torch.Tensor, dict[Sequence, int], int] | None:
        """For ModelRunner.execute: the drafts the verify step reads on the device (ids,
        columns, the row where sibling drafts start)."""
        p = self.pending
        return None if p is None else (p.ids, p.columns, p.sibling_row0)

    # -- after the step ------------------------------------------------------------------------
    def verify(self, seqs: list[Sequence], logits: torch.Tensor, offsets: list[int],
               greedy: torch.Tensor | None = None, greedy_host=None
               ) -> tuple[list[list[int]], list[int], list[list[float]]]:
        """Verify each sequence's drafts against its k + 1 logits rows starting at offsets[i];
        returns per sequence the emitted tokens, how many drafts were accepted, and the
        emitted tokens' logprobs under the model's distribution. `greedy` [2, rows]: the
        argmax and its logprob per row where the step computed them (a CUDA graph does);
        `greedy_host`: (the same on the host, the event of its copy), where copied early."""
        start = time.perf_counter()
        if all(s.params.greedy for s in seqs):
            # Every emitted token is the target's argmax at its row: the argmax and its
            # logprob per row are all the verification needs (one small transfer).
            if greedy_host is None:
                greedy_host = (greedy_with_logprobs(logits) if greedy is None else greedy,
                               None)
            host, event = greedy_host
            if event is not None:
                event.synchronize()
            argmax, lps = host.tolist()
            if any(s.spec_sibling_ids for s in seqs):
                tokens, accepted, self.tree_picks = greedy_verify_tree(
                    [s.spec_token_ids for s in seqs], [s.spec_sibling_ids for s in seqs],
                    [s.spec_sibling_width for s in seqs], argmax, offsets)
            else:
                tokens, accepted = greedy_verify_rows([s.spec_token_ids for s in seqs], argmax,
                                                      offsets)
            logprobs = [lps[o:o + len(t)] for o, t in zip(offsets, tokens)]
            self.stats.verify_time_s += time.perf_counter() - start
            return tokens, accepted, logprobs
        kmax = max(len(s.spec_token_ids) for s in seqs)
        idx = torch.tensor([[o + min(j, len(s.spec_token_ids)) for j in range(kmax + 1)]
                            for s, o in zip(seqs, offsets)], device=logits.device)
        target = logits[idx]  # [B, kmax + 1, V]; rows past a sequence's drafts repeat its last
        drafts = torch.tensor([s.spec_token_ids + [-1] * (kmax - len(s.spec_token_ids))
                               for s in seqs], device=logits.device)
        num = torch.tensor([len(s.spec_token_ids) for s in seqs], device=logits.device)
        probs = processed_probs(target, [s.params for s in seqs])
        result = rejection_sample(drafts, self._draft_probs(seqs, kmax, probs), probs, num,
                                  [s.generator for s in seqs])
        emitted = torch.tensor([t + [0] * (kmax + 1 - len(t)) for t in result.tokens],
                               device=logits.device)
        lp = target.float().log_softmax(-1).gather(-1, emitted[..., None]).squeeze(-1)
        logprobs = [row[:len(t)] for row, t in zip(lp.tolist(), result.tokens)]
        self.stats.verify_time_s += time.perf_counter() - start
        return result.tokens, result.num_accepted, logprobs

    @staticmethod
    def _draft_probs(seqs: list[Sequence], kmax: int, target_probs: torch.Tensor
                     ) -> torch.Tensor | None:
        """q [B, kmax, V] for the rejection sampler: the draft model's distributions where it
        sampled, one-hot rows for deterministic drafts (n-gram, greedy); None if all are."""
        if all(s.spec_draft_probs is None for s in seqs):
            return None
        q = torch.zeros(len(seqs), kmax, target_probs.shape[-1], device=target_probs.device)
        for b, s in enumerate(seqs):
            k = len(s.spec_token_ids)
            if s.spec_draft_probs is not None:
                q[b, :k] = s.spec_draft_probs[:k].to(q.device)
            else:
                q[b, torch.arange(k), torch.tensor(s.spec_token_ids)] = 1.0
        return q

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        """Book a verified step: the rejected drafts leave the computed tokens (the caller
        appends the emitted tokens, with its stop checks, then calls `rollback_blocks`)."""
        k = len(seq.spec_token_ids)
        # rejected drafts and every sibling's row leave the computed tokens (an accepted
        # sibling's KV was moved to its position's slot: `complete`)
        seq.num_computed_tokens -= k - num_accepted + len(seq.spec_sibling_ids)
        if self.draft is not None:
            # called before the emitted tokens are appended: num_tokens is still the count
            # the drafts were proposed after
            la = self.lookahead
            ahead = 0 if la is None else la.next_k.get(seq, 0)
            kept = self.draft.rollback(seq, seq.num_tokens, k, num_accepted, ahead)
            if ahead and kept is not None:
                la.kept[seq] = kept
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        seq.spec_sibling_ids = []
        self.stats.observe(k, num_accepted)
        self.batch_tracker.observe(k, num_accepted)
        seq.spec_stats.observe(k, num_accepted)
        if seq.spec_tracker is not None:
            seq.spec_tracker.observe(k, num_accepted)

    def complete(self, seqs: list[Sequence], logits: torch.Tensor, offsets: list[int],
                 now: float, scheduler, block_manager: BlockManager,
                 greedy: torch.Tensor | None = None, greedy_host=None) -> int:
        """Verify the drafts and emit each sequence's accepted tokens plus one, checking stops
        token by token (a stop inside an accepted run ends the output there); returns how many
        tokens were emitted."""
        if self.pending is not None:  # the drafts' copy was queued before the verify step
            self.pending.resolve()
            self.pending = None
        self.tree_picks = None
        all_tokens, all_accepted, logprobs = self.verify(seqs, logits, offsets, greedy,
                                                         greedy_host)
        if self.tree_picks is not None:
            self._move_accepted_siblings(seqs, self.tree_picks, block_manager.block_size)
        emitted = 0
        for seq, tokens, lps, accepted in zip(seqs, all_tokens, logprobs, all_accepted):
            self.accept(seq, accepted)
            seq.first_token_time = seq.first_token_time or now
            seq.last_step_logprobs = []
            for token, lp in zip(tokens, lps):
                seq.output_token_ids.append(token)
                seq.cumulative_logprob += lp
                seq.last_step_logprobs.append(lp)
                emitted += 1
                if self.stop_checker.check_token(seq):
                    scheduler.finish(seq, seq.finish_reason)
                    break
            if not seq.is_finished:
                self.rollback_blocks(seq, block_manager)
        return emitted

    def _move_accepted_siblings(self, seqs: list[Sequence], picks: list[int],
                                bs: int) -> None:
        """An accepted sibling's KV and feature, from its row's slot to the slot of its
        position (spec/tree.py); called before the emitted tokens are appended."""
        moves = []
        for seq, pick in zip(seqs, picks):
            if pick < 0:
                continue
            table, p, k = seq.block_table, seq.num_tokens - 1, len(seq.spec_token_ids)
            src = p + k + 1 + pick
            dst = p + sibling_depth(pick, seq.spec_sibling_width)
            moves.append((table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs))
        self.num_tree_accepted += len(moves)
        if moves:
            self.move_slots(moves)

    def release(self, seq: Sequence) -> None:
        """A sequence left the running set (finished, aborted, preempted): its draft KV goes."""
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        seq.spec_sibling_ids = []
        if self.draft is not None:
            self.draft.release(seq)

    def rollback_blocks(self, seq: Sequence, block_manager: BlockManager) -> None:
        """Drop table entries past what the sequence's tokens need (allocated for rejected
        drafts); a new list, as the CUDA-graph runner expects of a changed table."""
        keep = -(-seq.num_tokens // block_manager.block_size)
        if len(seq.block_table) > keep:
            block_manager.truncate(seq, keep)
