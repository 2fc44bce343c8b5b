"""Speculative method "head": an EAGLE-style draft head (models/eagle_head.py) proposes tokens
from the target's own hidden states.

The head keeps its own one-layer paged KV and runs like a draft model (spec/draft_model.py:
a catch-up step, then k - 1 single-token steps, drafts kept on the device for the verify
step), with two differences:

- Its input at head position i is the token at i + 1 and the target's feature f_i (with aux
  layers, f_i and the aux layers' hidden states, fused to the head's width first). The target
  writes every step's final hidden states into a cache indexed by KV slot
  (`TransformerForCausalLM.feature_cache`), so the catch-up gathers f_i for any position the
  target has computed: after a verify step, after plain steps (speculation switched off), or
  from prefix-cached blocks (same tokens at the same positions: same features).
- Drafted positions ran on the head's own outputs instead of the target's features, so after
  verification the head's KV is kept only up to the last real token; the next catch-up
  recomputes the accepted tokens with the target's features (1 + accepted rows, one layer).

With overlapped drafting (spec/overlap.py) that catch-up is launched right behind the verify
step, before the host knows the acceptance: a fixed k + 1 rows per sequence, of which the
first 1 + accepted write KV (`overlap_catch_up`).
"""

from __future__ import annotations


import torch

from llmaccel.engine.scheduler import SchedulerOutput
from llmaccel.engine.sequence import Sequence
from llmaccel.kernels.overlap_inputs import catch_up_inputs, chain_inputs, warm_up
from llmaccel.models.eagle_head import (
    DEFAULT_STATIC_ROWS,
    DraftHeadForCausalLM,
    load_draft_head,
)
from llmaccel.models.transformer import TransformerForCausalLM
from llmaccel.spec.draft_model import DraftModelProposer, DraftView


class HeadView(DraftView):
    """A sequence as the head sees it: head position i holds the sequence's token i + 1 (the
    feature at i is the target's), so it has one token fewer, followed by this step's drafts."""

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens - 1 + len(self.drafts)

    def token_at(self, i: int) -> int:
        return DraftView.token_at(self, i + 1)

    def token_slice(self, start: int, end: int) -> list[int]:
        return DraftView.token_slice(self, start + 1, end + 1)


class HeadProposer(DraftModelProposer):
    view_class = HeadView

    def __init__(self, head: DraftHeadForCausalLM, target: TransformerForCausalLM,
                 num_blocks: int, block_size: int, max_model_len: int,
                 kv_cache_dtype: torch.dtype, device: torch.device,
                 cudagraph_capture_sizes: list[int] | None = None,
                 num_speculative_tokens: int = 0, draft_topk: int = 1,
                 draft_chain: bool = True) -> None:
        if target.feature_cache is None:
            raise ValueError("the target keeps no feature cache for the draft head")
        rows = max(cudagraph_capture_sizes) if cudagraph_capture_sizes else DEFAULT_STATIC_ROWS
        # before the head's graphs are captured: they read and write these buffers
        head.model.allocate_buffers(rows, target.feature_cache.dtype, device)
        super().__init__(head, num_blocks, block_size, max_model_len, kv_cache_dtype, device,
                         cudagraph_capture_sizes, num_speculative_tokens, draft_topk,
                         draft_chain)
        self.target = target
        # heads without aux layers (their features go through `fuse` first)
        self.fused_catch_up_enabled = head.model.fuse is None
        if self.runner.graphs is not None and self.fused_catch_up_enabled:
            warm_up(max(1, num_speculative_tokens), head.model.hidden_size,
                    head.model.prev_token, target.feature_cache.dtype, device)
        self._last_rows: torch.Tensor | None = None  # the previous step's row of each view
        self._arange: torch.Tensor | None = None

    def _execute(self, step, next_ids, j):
        head = self.model.model
        device = head.static_features.device
        if j == 0:  # catch-up: the target's features of each view's new positions
            bs = self.block_manager.block_size
            slots: list[int] = []
            prev: list[int] = []  # prev_token: the sequence's tokens at those positions
            for view, n in step:
                table, start = view.seq.block_table, view.num_computed_tokens
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
                if head.prev_token:
                    prev += DraftView.token_slice(view, start, start + n)
            feats = head.fuse_target_features(
                self.target.feature_cache.index_select(0, _to_device(slots, device)))
            if head.prev_token:
                head.set_prev_ids(_to_device(prev, device))
        else:  # the head's own outputs at each still-drafting view's last row
            feats = self._last_outputs(len(step))
            if head.prev_token:  # and that row's input id
                head.set_prev_ids(self._last_ids(len(step)))
        rows = feats.shape[0]
        if rows <= head.static_features.shape[0]:
            head.static_features[:rows].copy_(feats)
        else:
            head.feature_input = feats  # an eager step larger than the static buffer
        try:
            result = self.runner.execute(SchedulerOutput(scheduled=step), next_ids)
        finally:
            head.feature_input = head.prev_input = None
        if j == 0:
            ends, total = [], 0
            for _, n in step:
                total += n
                ends.append(total - 1)
            self._last_rows = _to_device(ends, device)
        else:  # one row per view
            if self._arange is None or self._arange.shape[0] < len(step):
                self._arange = torch.arange(max(len(step), 64), device=device)
            self._last_rows = self._arange[:len(step)]
        return result

    def _chain(self, views, counts, first_ids, steps):
        # the first chained step's features: the catch-up's outputs at each view's last row;
        # later steps take the previous step's outputs inside the graph
        # (DraftHeadForCausalLM.prepare_chained_step)
        self.model.model.static_features[:len(views)].copy_(self._last_outputs(len(views)))
        if self.model.model.prev_token:
            self.model.model.set_prev_ids(self._last_ids(len(views)))
        return super()._chain(views, counts, first_ids, steps)

    def _last_outputs(self, n: int) -> torch.Tensor:
        """The previous head step's outputs at the last row of each of its first n views."""
        head = self.model.model
        out = head.static_out if self.runner.ran_graph else head.last_out
        return out.index_select(0, self._last_rows[:n])

    def _last_ids(self, n: int) -> torch.Tensor:
        """The previous head step's input ids at those rows (prev_token heads)."""
        head = self.model.model
        ids = head.static_ids if self.runner.ran_graph else head.last_ids
        return ids.index_select(0, self._last_rows[:n])

    # -- overlapped drafting (spec/overlap.py) --------------------------------------------------
    def overlap_catch_up_rows(self, num_seqs: int, kmax: int) -> int:
        return num_seqs * (kmax + 1)

    def overlap_catch_up_meta(self, seq: Sequence, k: int, kmax: int) -> list[int]:
        """The target's KV slots (its feature-cache rows) of positions p..p + k, where the
        verify step writes the features the catch-up reads; padded to kmax + 1 entries."""
        bs = self.block_manager.block_size
        p, table = seq.num_tokens - 1, seq.block_table
        slots = [table[q // bs] * bs + q % bs for q in range(p, p + k + 1)]
        return slots + [slots[-1]] * (kmax - k)

    def overlap_catch_up(self, views: list[HeadView], acc) -> tuple[torch.Tensor,
                                                                    torch.Tensor]:
        """The head's catch-up from the acceptance on the device (spec/overlap.py): kmax + 1
        rows per sequence, head position p + j with the token at p + j + 1 (d_{j+1} below a,
        the bonus at a; rows past a repeat the bonus, write no KV and are not read) and the
        target's feature at p + j -> (row a's argmax per sequence, the chain's start
        positions p + a + 1). Row a's output is also the chain's first feature."""
        head = self.model.model
        n, kmax = acc.drafts.shape
        width = kmax + 1
        j = torch.arange(width, device=acc.a.device)[None, :]
        a = acc.a[:, None]
        after = torch.cat([acc.drafts, acc.bonus[:, None]], 1)
        ids = torch.where(j < a, after, acc.bonus[:, None]).flatten()
        positions = (acc.p[:, None] + j).flatten()
        write = (j <= a).flatten()
        rows = torch.arange(0, n * width, width, device=acc.a.device) + acc.a
        slots = acc.extra
        if acc.sibling_hit is not None:
            # an accepted sibling's feature, at head position p + a, is in its own slot (the
            # host moves it to p + a's slot later: SpecDecoder.complete)
            at = acc.a.clamp(max=width - 1)[:, None]
            slots = slots.scatter(1, at, torch.where(acc.sibling_hit, acc.sibling_slot,
                                                     slots.gather(1, at)[:, 0])[:, None])
        head.static_features[:n * width].copy_(head.fuse_target_features(
            self.target.feature_cache.index_select(0, slots.flatten())))
        if head.prev_token:  # row j's token at its feature's position: row j - 1's (t0 at p)
            prev = torch.cat([acc.t0[:, None], ids.view(n, width)[:, :-1]], 1)
            head.set_prev_ids(prev.flatten().long())
        first = self.runner.execute_on_device([v for v in views for _ in range(width)], ids,
                                              positions, write, rows)[0]
        head.static_features[:n].copy_(head.static_out.index_select(0, rows))
        if head.prev_token:  # the chain's first step: row a's input id
            head.set_prev_ids(ids.index_select(0, rows).long())
        return first, acc.p + acc.a + 1

    def fused_catch_up(self, views: list[HeadView], meta: torch.Tensor, greedy: torch.Tensor,
                       drafts: torch.Tensor, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`launch_lookahead`'s acceptance and `overlap_catch_up` in two kernels
        (kernels/overlap_inputs.py) around the catch-up's graph: `meta` its per-sequence
        rows on the device, `greedy` the verify's argmax ids, `drafts` this round's draft
        ids (flat) -> as `overlap_catch_up`."""
        head = self.model.model
        graphs = self.runner.graphs
        prev = head.static_prev_ids if head.prev_token else None
        kernel = meta.device.type == "cuda"

        def prepare(inputs, lens, tables):
            return catch_up_inputs(greedy, drafts, meta, kmax, inputs, lens, tables,
                                   graphs.block_size, prev, self.target.feature_cache,
                                   head.static_features, use_kernel=kernel)

        width = kmax + 1
        (rows, starts), out = self.runner.execute_prepared(
            [v for v in views for _ in range(width)], prepare)
        first = chain_inputs(out[0], rows, head.static_out, head.static_features,
                             graphs.inputs[0], prev, use_kernel=kernel)
        return first, starts

    def rollback(self, seq: Sequence, real_tokens_before: int, num_drafts: int,
                 num_accepted: int, ahead: int = 0) -> int | None:
        """After verification: the head's KV holds valid entries only where its input was the
        target's feature, i.e. positions before the last real token of the step. Returns
        that count. `ahead`: the next round's k', already launched (spec/overlap.py): its
        catch-up recomputed head positions through p + a from the target's features and its
        chain k' - 1 more, so the view is booked as after a proposal of k' drafts."""
        view = seq.draft_view
        if view is None:
            return None
        kept = min(view.num_computed_tokens, real_tokens_before - 1)
        if ahead:
            # head positions p + a + 1 = real_tokens_before + num_accepted computed, plus
            # the chain's k' - 1 (the head has one position fewer than the sequence)
            view.num_computed_tokens = real_tokens_before + num_accepted + ahead - 1
            view.drafts = [0] * ahead  # stand for the drafts still on the device
            self.trim(view)
        else:
            self.keep(view, kept)
        return kept


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 indices on the device without a host sync: a copy from pageable memory waits for
    the stream (the head's steps launched before it), one from pinned memory does not."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def feature_bytes_per_block(head: DraftHeadForCausalLM, block_size: int,
                            dtype: torch.dtype) -> int:
    """The feature cache's share of each KV block (one row of the head's feature width per
    slot: the final hidden state, and with aux layers theirs)."""
    return block_size * head.model.feature_width * dtype.itemsize


def load_head_for(config, target: TransformerForCausalLM, target_model_config,
                  device: torch.device) -> DraftHeadForCausalLM | None:
    """The draft head of a speculative_config with method 'head' (else None)."""
    spec = config.speculative_config
    if spec is None or spec.method != "head":
        return None
    return load_draft_head(spec.model, target, target_model_config.max_model_len, device,
                           target_model_config.dtype, spec.draft_vocab_size)
