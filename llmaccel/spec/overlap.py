"""Overlapped drafting: a draft model's next round launched before the host has seen this
round's verification (greedy rows; vLLM and SGLang call this overlap or async scheduling).

A speculative round is the draft's catch-up step and k - 1 chained steps, then the target's
verify step; then the host learns how many drafts were accepted, books them, and launches the
next round. Plain decoding hides that host time by launching the next step before sampling
(async scheduling). A speculative round could not: its inputs depend on the acceptance. On an
H100 (the 0.5B drafting for the 1.5B shape, batch 1) the GPU waited ~0.26 ms before each
catch-up, and the catch-up took ~0.17 ms longer than a chained step of the same size, the host
preparing its inputs while the GPU idled: ~8% of a round.

Here, right after the verify step is launched, the next round's drafts are launched too, with
their inputs computed on the device from the verify step's argmax. For a sequence whose last
real token t0 sits at position p and whose drafts d1..dk follow it:

- a = the number of leading drafts equal to the target's argmax at their rows; the bonus token
  is the argmax after them, at position p + a + 1;
- the catch-up runs two rows: the token at p + a (t0 when a = 0, else d_a), which writes its KV
  only when a = k (the draft never computed d_k; below k that KV exists already), and the
  bonus token, whose argmax is the next round's first draft;
- the chain (engine/cuda_graph.py) continues from p + a + 2 for the next round's k' - 1 steps.

A draft head (spec/head_proposer.py) catches up differently: its KV past the last real token was
computed from its own outputs, not the target's features, so it recomputes head positions
p..p + a from the features the verify step just wrote. The number of rows cannot depend on a
(the host does not know it), so it runs k + 1 rows per sequence, head position p + j taking
the token at p + j + 1 (d_{j+1} for j < a, the bonus at j = a) and the target's feature at
p + j; rows j <= a write KV, the rest are computed and ignored. Row a's output gives the next
round's first draft and the chain's first feature; the chain continues from head position
p + a + 1. Each proposer says how (`overlap_catch_up`).

The next round's k' is chosen before the acceptance is known: from the acceptance tracked so
far, and cut by max_tokens and the context as if all k drafts were accepted (the most this
round can emit). The draft blocks are allocated for that case too.

After verification the host books the draft KV as the overlapped round left it
(DraftModelProposer.rollback with `ahead`). The next round uses the drafts when the running
set is the same and still speculates; otherwise they are dropped (`Lookahead.revert`): the KV
written past the accepted tokens is stale and is overwritten later, as after any rejection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from llmaccel.kernels.greedy_select import greedy_with_logprobs
from llmaccel.engine.sequence import Sequence
from llmaccel.spec.draft_model import PENDING_DRAFT


@dataclass(eq=False)
class Lookahead:
    """The next round's drafts, launched during this round: its sequences (this round's
    drafting sequences, in order), each one's k', the drafts on the device, and, once booked
    after verification, the draft KV count a round without overlap would have kept (to
    revert to)."""

    seqs: list[Sequence]
    next_k: dict[Sequence, int]
    drafts: object  # spec/draft_model.DeviceDrafts
    kept: dict[Sequence, int] = field(default_factory=dict)

    def revert(self, proposer) -> None:
        """Drop the overlapped drafts: each booked sequence's draft KV back to what a round
        without overlap keeps, its blocks past that returned."""
        for seq, kept in self.kept.items():
            view = seq.draft_view
            if view is not None:  # else released meanwhile (finished, aborted, preempted)
                proposer.keep(view, kept)


@dataclass
class AcceptedOnDevice:
    """What the next round's catch-up is computed from, per sequence, on the device: p (the
    position of t0, the last real token before this round's drafts), t0, k (drafts this
    round), a (how many were accepted), the bonus token (the target's argmax after them, at
    p + a + 1), this round's drafts [n, kmax] and the proposer's own columns (`extra`,
    from `overlap_catch_up_meta`)."""

    p: torch.Tensor
    t0: torch.Tensor
    k: torch.Tensor
    a: torch.Tensor
    bonus: torch.Tensor
    drafts: torch.Tensor
    extra: torch.Tensor
    # tree drafts (spec/tree.py): per sequence, whether a sibling was accepted (then it is
    # drafts[a - 1], counted in a, and the bonus is its row's argmax) and its KV slot
    sibling_hit: torch.Tensor | None = None
    sibling_slot: torch.Tensor | None = None


def set_pending_siblings(seqs: list[Sequence], drafts) -> None:
    """Tree drafts still on the device (a DeviceDrafts of topk > 1): each greedy sequence
    whose drafts are there gets placeholders for its k * (topk - 1) siblings
    (DeviceDrafts.resolve writes them)."""
    if drafts is None or drafts.topk == 1:
        return
    w = drafts.topk - 1
    for seq in seqs:
        if seq in drafts.columns and seq.spec_token_ids and seq.params.greedy:
            seq.spec_sibling_ids = [PENDING_DRAFT] * (len(seq.spec_token_ids) * w)
            seq.spec_sibling_width = w


def _accept_siblings(acc: AcceptedOnDevice, target_sib: torch.Tensor, mine_sib: torch.Tensor,
                     valid_sib: torch.Tensor, slot_sib: torch.Tensor) -> AcceptedOnDevice:
    """spec/tree.greedy_verify_tree on the device: where the chain stopped at a < k, the
    first sibling of depth a + 1 equal to the target's token there is accepted. Sibling
    tensors are [n, kmax, width]: the target's argmax at each sibling's row, the sibling, its
    validity and its slot."""
    n, kmax, w = mine_sib.shape
    a = acc.a
    at = a.clamp(max=kmax - 1)[:, None, None].expand(n, 1, w)
    want = acc.bonus[:, None]  # the target's token after the accepted chain
    cand = mine_sib.gather(1, at)[:, 0]
    match = (cand == want) & valid_sib.gather(1, at)[:, 0] & (a < acc.k)[:, None]
    hit = match.any(1)
    r = match.long().argmax(1)[:, None]  # the first match
    token = cand.gather(1, r)[:, 0]
    drafts = acc.drafts.scatter(1, a.clamp(max=kmax - 1)[:, None], torch.where(
        hit, token, acc.drafts.gather(1, a.clamp(max=kmax - 1)[:, None])[:, 0])[:, None])
    bonus = torch.where(hit, target_sib.gather(1, at)[:, 0].gather(1, r)[:, 0], acc.bonus)
    slot = slot_sib.gather(1, at)[:, 0].gather(1, r)[:, 0]
    return AcceptedOnDevice(p=acc.p, t0=acc.t0, k=acc.k, a=a + hit.long(), bonus=bonus,
                            drafts=drafts, extra=acc.extra, sibling_hit=hit,
                            sibling_slot=slot)

@torch.inference_mode()
def launch_lookahead(proposer, seqs: list[Sequence], ks: list[int], next_ks: list[int],
                     greedy: torch.Tensor, offsets: list[int], drafts) -> object | None:
    """Launch the next round's drafts for `seqs` (drafting ks[i] tokens this round, their
    verify rows starting at offsets[i] of the target's greedy [2, rows]; this round's drafts
    on the device in `drafts`, a DeviceDrafts) -> the next round's DeviceDrafts, next_ks[i]
    per sequence; None where it cannot run (no graphs, no draft blocks), with nothing
    launched."""
    runner = proposer.runner
    n, kmax, kn = len(seqs), max(ks), max(next_ks)
    if (not runner.can_run_on_device(proposer.overlap_catch_up_rows(n, kmax))
            or (kn > 1 and not runner.can_chain(n, kn - 1))):
        return None
    views = [seq.draft_view for seq in seqs]
    if any(v is None for v in views):
        return None
    # the catch-up's rows and the chain's k' - 1 positions, if all k drafts are accepted
    if not all(proposer.block_manager.allocate_slots(v, k2 + 1)
               for v, k2 in zip(views, next_ks)):
        return None  # blocks allocated so far are returned when the round is booked
    device = greedy.device
    width = drafts.ids.shape[1]
    # one host-to-device transfer: per sequence its argmax rows (o + min(j, k), j <= kmax),
    # its draft indexes in drafts.ids (min(j, k - 1) * width + column, j < kmax), whether
    # draft j exists, what the proposer's catch-up needs besides, with tree drafts the
    # siblings' rows, indexes, validity and slots (kmax * w each), then p (t0's position),
    # t0 and k
    w = drafts.topk - 1
    row0 = drafts.sibling_row0
    host = []
    for seq, k, o in zip(seqs, ks, offsets):
        col = drafts.columns[seq]
        p = seq.num_tokens - 1
        extra = proposer.overlap_catch_up_meta(seq, k, kmax)
        if w:
            has = len(seq.spec_sibling_ids) == k * w  # else cut by the token budget
            ok = [has and i < k * w for i in range(kmax * w)]
            table, block = seq.block_table, proposer.block_manager.block_size  # the target's
            extra += ([o + 1 + k + i if v else o for i, v in enumerate(ok)]
                      + [(row0 + i) * width + col if v else col for i, v in enumerate(ok)]
                      + [int(v) for v in ok]
                      + [table[(p + k + 1 + i) // block] * block + (p + k + 1 + i) % block
                         if v else 0 for i, v in enumerate(ok)])
        host.append([o + min(j, k) for j in range(kmax + 1)]
                    + [min(j, k - 1) * width + col for j in range(kmax)]
                    + [int(j < k) for j in range(kmax)]
                    + extra + [p, seq.token_at(p), k])
    meta = torch.tensor(host, dtype=torch.long)
    if device.type == "cuda":  # pinned: the copy is queued, the host does not wait for it
        meta = meta.pin_memory()
    meta = meta.to(device, non_blocking=True)
    if not w and proposer.fused_catch_up_enabled:
        # the acceptance and the catch-up's inputs in two kernels (a draft head)
        first, starts = proposer.fused_catch_up(views, meta, greedy[0],
                                                drafts.ids.reshape(-1), kmax)
        return _chain_rest(proposer, seqs, views, next_ks, first, starts, kn, w)
    trow, drow = meta[:, :kmax + 1], meta[:, kmax + 1:2 * kmax + 1]
    valid = meta[:, 2 * kmax + 1:3 * kmax + 1].bool()
    target = greedy[0].index_select(0, trow.flatten()).view(n, kmax + 1).long()
    mine = drafts.ids.reshape(-1).index_select(0, drow.flatten()).view(n, kmax).long()
    a = ((mine == target[:, :kmax]) & valid).long().cumprod(1).sum(1)
    extra = meta[:, 3 * kmax + 1:-3]
    sib = None
    if w:
        m = kmax * w
        extra, sib = extra[:, :-4 * m], extra[:, -4 * m:]
    accepted = AcceptedOnDevice(p=meta[:, -3], t0=meta[:, -2], k=meta[:, -1], a=a,
                                bonus=target.gather(1, a[:, None])[:, 0], drafts=mine,
                                extra=extra)
    if sib is not None:
        m = kmax * w
        target_sib = greedy[0].index_select(0, sib[:, :m].flatten()).view(n, kmax, w).long()
        mine_sib = drafts.ids.reshape(-1).index_select(0, sib[:, m:2 * m].flatten()).view(
            n, kmax, w).long()
        accepted = _accept_siblings(accepted, target_sib, mine_sib,
                                    sib[:, 2 * m:3 * m].bool().view(n, kmax, w),
                                    sib[:, 3 * m:].view(n, kmax, w))
    first, starts = proposer.overlap_catch_up(views, accepted)
    return _chain_rest(proposer, seqs, views, next_ks, first, starts, kn, w)


def _chain_rest(proposer, seqs: list[Sequence], views: list, next_ks: list[int],
                first: torch.Tensor, starts: torch.Tensor, kn: int, w: int) -> object:
    """After the catch-up (its argmax `first` per sequence, the chain's start positions):
    the chain of the next round's k' - 1 steps, all of it queued to the host."""
    runner = proposer.runner
    n = len(seqs)
    out = first.new_empty(kn * (1 + w), n)
    out[0] = first
    if w:  # the catch-up row's runners-up: the next round's siblings of depth 1
        out[kn:kn + w] = runner.graphs.last_rows_siblings.T
    if kn > 1:
        out[1:kn] = runner.execute_chain(views, [k2 - 1 for k2 in next_ks], first, kn - 1,
                                         starts=starts)
        if w:
            out[kn + w:] = runner.graphs.last_chain_siblings
    return proposer._to_host(out, {seq: r for r, seq in enumerate(seqs)}, 1 + w)


def launch_next_round(spec, sampling: list[Sequence], logits: torch.Tensor,
                      greedy: torch.Tensor | None, rows_per_seq: list[int],
                      running: list[Sequence], waiting: int, copy_to_host
                      ) -> tuple[Lookahead | None, object | None]:
    """For SpecDecoder.overlap (`spec`), right after a verify step of `sampling` was launched:
    launch the next round's drafts where that round is sure to be a speculative round of the
    same greedy sequences -- a draft model that supports it, this round's drafts on the
    device, every running sequence drafting in this step (with ngram_first: none of them
    took lookup drafts), no request waiting, no confidence threshold, the next round
    speculating at this batch size, no request near its end. The next round's k (adaptive)
    is chosen from the acceptance before this round's. With ngram_first the next round may
    still take lookup drafts (the lookup needs this round's accepted tokens): then these
    drafts are dropped (SpecDecoder.propose).

    Returns the Lookahead (or None) and the verify step's greedy [2, rows] copied to the
    host (`copy_to_host` -> (host tensor, event)), queued before the drafts: a read of the
    device tensor would wait for the drafts queued behind the step."""
    drafts = spec.pending
    if (drafts is None or not spec.config.draft_overlap or waiting
            or not getattr(spec.draft, "supports_overlap", False)
            or spec.config.draft_confidence_threshold > 0.0
            or sampling != running
            or any(seq not in drafts.columns or not seq.spec_token_ids
                   or not seq.params.greedy for seq in sampling)
            or not spec.speculate_at(len(running))):
        return None, None
    ks = [len(seq.spec_token_ids) for seq in sampling]
    # Near a request's end (max_tokens, the context) the next round's k depends on how many
    # tokens this one emits: those rounds draft as usual, after verification.
    full = spec.config.num_speculative_tokens
    if not all(spec._room(seq, k + 1) >= full for seq, k in zip(sampling, ks)):
        return None, None
    cost = spec._cost(len(running))
    memo: dict[float, int] = {}
    next_ks = [spec._wanted_k(seq, cost, memo) for seq in sampling]
    offsets = list(accumulate(rows_per_seq[:-1], initial=0))  # each one's first verify row
    if greedy is None:  # an eager verify step: its argmax, on the device
        greedy = greedy_with_logprobs(logits)
    host = None if copy_to_host is None else copy_to_host(greedy)
    ahead = launch_lookahead(spec.draft, sampling, ks, next_ks, greedy, offsets, drafts)
    if ahead is None:
        return None, host
    return Lookahead(list(sampling), dict(zip(sampling, next_ks)), ahead), host


def use_lookahead(spec, lookahead: Lookahead, running: list[Sequence], on: bool) -> bool:
    """For SpecDecoder.propose (`spec`): take the drafts launched during the last round if
    this round speculates for the same sequences (their placeholders and the pending
    DeviceDrafts set, as a proposal would); else drop them (`revert`). Returns whether they
    were taken."""
    if on and running == lookahead.seqs and all(map(spec._eligible, running)):
        full = spec.config.num_speculative_tokens
        for seq in running:
            k = lookahead.next_k[seq]
            seq.spec_token_ids, seq.spec_draft_probs = [PENDING_DRAFT] * k, None
            seq.spec_sibling_ids = []
            spec._capped = spec._capped or spec._room(seq) < full
        set_pending_siblings(running, lookahead.drafts)
        spec.pending = lookahead.drafts
        spec.num_overlapped += 1
        return True
    lookahead.revert(spec.draft)
    spec.num_overlap_dropped += 1
    return False
