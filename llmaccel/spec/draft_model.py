"""A draft model that proposes tokens for the target: a smaller model with the same tokenizer,
with its own paged KV cache, block pool and model runner (CUDA graphs for its decode steps).

Each step, for every drafting sequence: one catch-up pass feeds the tokens the draft has not
seen yet (the whole prompt the first time, then the previous step's accepted drafts and the
target's token), whose last logits give draft 1; then k - 1 single-token decode steps give the
rest. The draft's KV stays valid for every token the target accepts, so after verification
only `num_computed_tokens` is lowered to the accepted prefix (and unneeded blocks returned).
Sampled requests draft by sampling the draft's processed distribution q (kept for the
rejection sampler); greedy requests draft its argmax.

Greedy drafting without a confidence threshold runs the k - 1 steps after the catch-up as one
chained CUDA graph (engine/cuda_graph.py) where one is captured: one launch instead of k - 1.

Without a confidence threshold the drafts can stay on the device (`keep_on_device`): the
target's verify step reads them from there (ModelRunner.execute patches its input ids), so the
host launches verification while the draft model still runs, and learns the drafts from a
copy that lands with the verify step's results (`DeviceDrafts.resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmaccel.engine.block_manager import BlockManager
from llmaccel.engine.kv_cache import allocate_kv_caches
from llmaccel.engine.model_runner import ModelRunner
from llmaccel.kernels.greedy_select import greedy_with_logprobs
from llmaccel.engine.scheduler import SchedulerOutput
from llmaccel.engine.sequence import Sequence
from llmaccel.spec.config import SpeculativeConfigError
from llmaccel.spec.verifier import processed_probs


@dataclass(eq=False)
class DraftView:
    """One sequence as the draft model sees it: what ModelRunner.execute reads (tokens, the
    draft's block table, how many tokens have draft KV), nothing of the target's state. Its
    tokens are the target sequence's (read in place: copying a growing context every step
    would cost O(length)) followed by this step's drafts."""

    seq: Sequence
    drafts: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_published_blocks: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # always empty for the draft
    spec_sibling_ids: list[int] = field(default_factory=list)  # likewise

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.drafts)

    def token_at(self, i: int) -> int:
        n = self.seq.num_tokens
        return self.seq.token_at(i) if i < n else self.drafts[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = self.seq.num_tokens
        return (self.seq.token_slice(start, min(end, n))
                + self.drafts[max(0, start - n):max(0, end - n)])


# Stands for a draft whose id is still on the device (DeviceDrafts); never a real id.
PENDING_DRAFT = -1


@dataclass(eq=False)
class DeviceDrafts:
    """Drafts on the device: ids [steps, rows] (float64, exact), the column of each drafting
    sequence (whose spec_token_ids hold PENDING_DRAFT until `resolve`), and their copy to
    pinned host memory, in flight from the moment the last draft step was launched."""

    ids: torch.Tensor
    columns: dict[Sequence, int]
    host: torch.Tensor
    copied: torch.cuda.Event | None
    # tree drafts (spec/tree.py): ids holds steps * topk rows, the chain's steps first, then
    # each step's topk - 1 runners-up (row steps + j * (topk - 1) + r)
    topk: int = 1

    @property
    def sibling_row0(self) -> int:
        """The row of `ids` where the siblings start (the chain's step count)."""
        return self.ids.shape[0] // self.topk

    def resolve(self) -> None:
        """Wait for the host copy and write the drafts into each sequence's spec_token_ids
        and spec_sibling_ids (as many as the scheduler kept: a token budget may have cut
        some)."""
        if self.copied is not None:
            self.copied.synchronize()
        host = self.host.tolist()
        row0 = self.sibling_row0
        for seq, col in self.columns.items():
            k = len(seq.spec_token_ids)
            seq.spec_token_ids = [int(host[j][col]) for j in range(k)]
            if seq.spec_sibling_ids:
                seq.spec_sibling_ids = [int(host[row0 + i][col])
                                        for i in range(len(seq.spec_sibling_ids))]


def check_vocab_compatible(target_config, draft_config, target_tokenizer=None,
                           draft_tokenizer=None, draft_name: str = "draft") -> None:
    """A draft must score the target's token ids: same vocabulary size and, where both
    tokenizers are loaded, the same token -> id map."""
    tv, dv = target_config.vocab_size, draft_config.vocab_size
    if tv != dv:
        raise SpeculativeConfigError(
            f"draft model {draft_name} has vocab_size {dv}, the target {tv}: a draft model "
            "must share the target's tokenizer")
    if (target_tokenizer is not None and draft_tokenizer is not None
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab()):
        raise SpeculativeConfigError(
            f"draft model {draft_name} has a different tokenizer vocabulary from the "
            "target's: a draft model must share the target's tokenizer")


class DraftModelProposer:
    def __init__(self, model, num_blocks: int, block_size: int, max_model_len: int,
                 kv_cache_dtype: torch.dtype, device: torch.device,
                 cudagraph_capture_sizes: list[int] | None = None,
                 num_speculative_tokens: int = 0, draft_topk: int = 1,
                 draft_chain: bool = True) -> None:
        """`num_speculative_tokens`: the most drafts a step asks for; with CUDA graphs and
        `draft_chain`, the k - 1 steps after the catch-up run as one chained graph (`_chain`).
        `draft_topk` > 1: tree drafts (spec/tree.py), each step's runners-up kept beside its
        draft."""
        self.model = model
        self.draft_topk = draft_topk
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, allocate_kv_caches(model, num_blocks, block_size,
                                                            kv_cache_dtype, device),
                                  block_size, max_model_len, cudagraph_capture_sizes,
                                  chain_steps=max(0, num_speculative_tokens - 1)
                                  if draft_chain else 0,
                                  chain_topk=draft_topk)
        # pinned, for DeviceDrafts.host; two, used in turn: with overlapped drafting the next
        # round's drafts are copied out before this round's are read (spec/overlap.py)
        self._host_ids: list[torch.Tensor | None] = [None, None]
        self._host_flip = 0

    view_class = DraftView  # how a sequence looks to the proposer's model
    # whether the next round's drafts may be launched before verification (spec/overlap.py)
    supports_overlap = True
    # whether `fused_catch_up` replaces the acceptance and `overlap_catch_up` (a draft head's)
    fused_catch_up_enabled = False

    def _view(self, seq: Sequence) -> DraftView:
        if seq.draft_view is None:
            seq.draft_view = self.view_class(seq)
        view = seq.draft_view
        view.drafts = []
        return view

    def release(self, seq: Sequence) -> None:
        """Give back the draft's blocks of a finished, aborted or preempted sequence."""
        view = seq.draft_view
        if view is not None:
            self.block_manager.free(view)
            seq.draft_view = None

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], confidence_threshold: float = 0.0,
                keep_on_device: bool = False
                ) -> tuple[list[list[int]], list[torch.Tensor | None], DeviceDrafts | None]:
        """Up to ks[i] drafts for seqs[i], for sampled requests the draft's processed
        distributions [len(drafts), vocab] they were drawn from (None for greedy requests:
        their drafts are argmaxes), and the drafts still on the device (else None). A
        sequence whose draft blocks cannot be allocated drafts nothing this step.

        Without a confidence threshold the draft steps run back to back with no host sync:
        each step's tokens stay on the device as the next step's input ids, and all drafts
        come to the host in one transfer at the end -- or, with `keep_on_device`, the drafts
        are PENDING_DRAFT placeholders and the DeviceDrafts carry them (no sync at all). A
        threshold needs each step's confidences on the host to decide who goes on, so it
        syncs every step."""
        views = [self._view(seq) for seq in seqs]
        active = []
        for i, k in enumerate(ks):
            n = views[i].num_tokens - views[i].num_computed_tokens
            # room for the catch-up tokens and k - 1 drafts (the last draft's KV is never needed)
            if k > 0 and n > 0 and self.block_manager.allocate_slots(views[i], n + k - 1):
                active.append(i)
        # Longest k first: the rows that go on drafting are then a prefix of the last step's.
        active.sort(key=lambda i: -ks[i])
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        if not active:
            return drafts, [None] * len(seqs), None
        sync = confidence_threshold > 0.0
        steps = ks[active[0]]
        step = [(views[i], views[i].num_tokens - views[i].num_computed_tokens) for i in active]
        on_device: torch.Tensor | None = None  # [steps, rows] draft ids, when not syncing
        next_ids: torch.Tensor | None = None
        for j in range(steps):
            if not step:
                break
            _, logits, greedy = self._execute(step, next_ids, j)
            for view, n in step:
                view.num_computed_tokens += n
            rows = active[:len(step)]
            tokens, probs, confidence = self._choose([seqs[i] for i in rows], logits, greedy,
                                                     want_confidence=sync)
            for r, i in enumerate(rows):
                if probs is not None and not seqs[i].params.greedy:
                    qs[i].append(probs[r])
            if sync:
                host_tokens, host_conf = torch.stack([tokens, confidence]).tolist()
                still = [i for r, i in enumerate(rows)
                         if j + 1 < ks[i] and host_conf[r] >= confidence_threshold]
                for r, i in enumerate(rows):
                    drafts[i].append(int(host_tokens[r]))
                    views[i].drafts.append(int(host_tokens[r]))
                active = still + [i for i in active if i not in still]
                next_ids = None
            else:
                w = self.draft_topk - 1 if probs is None else 0  # tree drafts: greedy only
                if on_device is None:
                    on_device = tokens.new_empty(steps * (1 + w), len(rows))
                on_device[j, :len(rows)] = tokens
                if w:  # this step's runners-up (spec/tree.py)
                    ups = self.model.runners_up(logits, w)
                    on_device[steps + j * w:steps + (j + 1) * w, :len(rows)] = ups.T
                still = [i for i in rows if j + 1 < ks[i]]  # a prefix of rows (sorted by k)
                for i in rows:
                    views[i].drafts.append(0)  # stands for the token still on the device
                next_ids = tokens[:len(still)]
                if (j == 0 and still and probs is None
                        and self.runner.can_chain(len(rows), steps - 1)):
                    # all greedy: the other steps in one launch, every row to its own k
                    counts = [ks[i] - 1 for i in rows]
                    on_device[1:steps] = self._chain([views[i] for i in rows], counts, tokens,
                                                     steps - 1)
                    if w:
                        on_device[steps + w:] = self.runner.graphs.last_chain_siblings
                    for i, c in zip(rows, counts):
                        views[i].num_computed_tokens += c
                        views[i].drafts += [0] * c
                    break
            step = [(views[i], 1) for i in still]
        out_q = [torch.stack(q) if q else None for q in qs]
        if on_device is not None and keep_on_device:
            for i in active:  # the views keep their placeholder drafts (only counted)
                drafts[i] = [PENDING_DRAFT] * ks[i]
            return drafts, out_q, self._to_host(on_device, {seqs[i]: r for r, i in
                                                           enumerate(active)},
                                                on_device.shape[0] // steps)
        if on_device is not None:
            host = on_device[:steps].tolist()
            for r, i in enumerate(active):
                drafts[i] = [int(host[j][r]) for j in range(ks[i])]
                views[i].drafts = list(drafts[i])
        return drafts, out_q, None

    def _execute(self, step: list[tuple[DraftView, int]], next_ids: torch.Tensor | None,
                 j: int) -> tuple[list, torch.Tensor, torch.Tensor | None]:
        """Draft step j over `step` (view, tokens) pairs: the catch-up at j = 0, then one
        token per still-drafting view (a prefix of the previous step's views)."""
        return self.runner.execute(SchedulerOutput(scheduled=step), next_ids)

    def _chain(self, views: list[DraftView], counts: list[int], first_ids: torch.Tensor,
               steps: int) -> torch.Tensor:
        """Greedy draft steps 1..`steps` of `views` (those of the catch-up, in its order)
        chained in one graph: counts[r] of them for views[r] -> draft ids [steps, rows]."""
        return self.runner.execute_chain(views, counts, first_ids, steps)

    def _to_host(self, ids: torch.Tensor, columns: dict[Sequence, int],
                 topk: int = 1) -> DeviceDrafts:
        """Start copying `ids` to a reused pinned buffer (read back in the verify step, before
        the next round's drafts are copied there)."""
        if not ids.is_cuda:
            return DeviceDrafts(ids, columns, ids.clone(), None, topk)
        flip, self._host_flip = self._host_flip, self._host_flip ^ 1
        buf = self._host_ids[flip]
        if buf is None or buf.numel() < ids.numel():
            buf = self._host_ids[flip] = torch.empty(max(ids.numel(), 1024), dtype=ids.dtype,
                                                     pin_memory=True)
        host = buf[:ids.numel()].view(ids.shape)
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return DeviceDrafts(ids, columns, host, event, topk)

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor, greedy: torch.Tensor | None,
                want_confidence: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """On the device, per row: the next draft token as float64 (argmax for greedy
        requests, a sample from the processed q otherwise), q when any row samples (else
        None: greedy drafts are deterministic), and with `want_confidence` the draft's
        confidence: the top probability of its own softmax (exp of the argmax's logprob)."""
        if greedy is None:
            greedy = greedy_with_logprobs(logits)
        tokens = greedy[0]
        confidence = greedy[1].exp() if want_confidence else None
        probs = None
        if not all(s.params.greedy for s in seqs):
            tokens = tokens.clone()
            probs = processed_probs(logits[:, None, :], [s.params for s in seqs])[:, 0]
            for r, seq in enumerate(seqs):
                if not seq.params.greedy:
                    tokens[r] = torch.multinomial(probs[r], 1, generator=seq.generator)[0]
        return tokens, probs, confidence

    # -- overlapped drafting (spec/overlap.py) --------------------------------------------------
    def overlap_catch_up_rows(self, num_seqs: int, kmax: int) -> int:
        """Rows of the catch-up that `overlap_catch_up` runs for num_seqs sequences."""
        return 2 * num_seqs

    def overlap_catch_up_meta(self, seq: Sequence, k: int, kmax: int) -> list[int]:
        """Per sequence, host-known values the catch-up reads on the device (AcceptedOnDevice
        .extra): none for a draft model."""
        return []

    def overlap_catch_up(self, views: list[DraftView], acc) -> tuple[torch.Tensor,
                                                                     torch.Tensor]:
        """Launch the next round's catch-up from this round's acceptance on the device
        (`acc`: spec/overlap.AcceptedOnDevice) -> (the next round's first drafts [n], the
        chain's start positions [n]). Two rows per sequence: the token at p + a, writing KV
        only when a = k (below k the draft computed it already), and the bonus token; the
        chain starts at p + a + 2."""
        n = len(views)
        p, a = acc.p, acc.a
        x1 = torch.cat([acc.t0[:, None], acc.drafts], 1).gather(1, a[:, None])[:, 0]
        ids = torch.stack([x1, acc.bonus], 1).flatten()
        positions = torch.stack([p + a, p + a + 1], 1).flatten()
        write = torch.stack([a == acc.k, torch.ones_like(a, dtype=torch.bool)], 1).flatten()
        rows = torch.arange(1, 2 * n, 2, device=a.device)
        first = self.runner.execute_on_device([v for v in views for _ in range(2)], ids,
                                              positions, write, rows)[0]
        return first, p + a + 2

    def rollback(self, seq: Sequence, real_tokens_before: int, num_drafts: int,
                 num_accepted: int, ahead: int = 0) -> int | None:
        """After verification: the draft's KV holds the real tokens and drafts 1..k-1; it stays
        valid for the accepted ones (they equal what the target emitted). Returns the draft
        KV count kept (None without a view). `ahead`: the next round's k', already launched
        (spec/overlap.py): its catch-up computed the rest of the accepted tokens and the
        target's token, and its chain k' - 1 drafts, so the view is booked as after a
        proposal of k' drafts."""
        view = seq.draft_view
        if view is None:
            return None
        kept = min(view.num_computed_tokens,
                   real_tokens_before + min(num_accepted, num_drafts - 1))
        if ahead:
            # real_tokens_before + num_accepted + 1 tokens after this step, plus k' - 1 drafts
            view.num_computed_tokens = real_tokens_before + num_accepted + ahead
            view.drafts = [0] * ahead  # stand for the drafts still on the device
            self.trim(view)
        else:
            self.keep(view, kept)
        return kept

    def keep(self, view: DraftView, num_computed: int) -> None:
        """Keep the view's KV for its first `num_computed` tokens only, without drafts (the
        rest is stale: later steps overwrite it); blocks past that returned."""
        view.num_computed_tokens = num_computed
        view.drafts = []
        self.trim(view)

    def trim(self, view: DraftView) -> None:
        """Return the view's blocks past its computed tokens and the next one's slot."""
        keep = -(-(view.num_computed_tokens + 1) // self.block_manager.block_size)
        if len(view.block_table) > keep:
            self.block_manager.truncate(view, keep)


def load_draft_model(config, target_model_config, device: torch.device):
    """The draft model of a speculative_config with method 'draft' (else None), loaded like
    the target (dtype, load format, max_model_len) and checked to share its vocabulary."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft":
        return None
    from llmaccel.models.config import make_model_config
    from llmaccel.models.loader import get_model
    from llmaccel.models.tokenizer import get_tokenizer

    tmc = target_model_config
    dmc = make_model_config(spec.model, dtype=config.dtype, max_model_len=tmc.max_model_len,
                            load_format=config.load_format, device=device)
    tokenizers = (None, None)
    if not config.skip_tokenizer_init and tmc.source.kind != "shape":
        tokenizers = (get_tokenizer(tmc, config.tokenizer), get_tokenizer(dmc))
    check_vocab_compatible(tmc.hf_config, dmc.hf_config, *tokenizers, draft_name=spec.model)
    return get_model(dmc, device, attention_backend=config.attention_backend, seed=config.seed)
