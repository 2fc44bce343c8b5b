"""Turns a scheduled step into one flat forward pass and returns the logits to sample from.

Steps of a few tokens per sequence (decode, speculative verification, a draft's catch-up) run
as decode rows and replay a captured CUDA graph when one fits (see cuda_graph.py). So do small
prefill and mixed steps on a GPU (`prefill_rows_kv_bytes`): eagerly, a short prompt's prefill
is bound by the host launching ~10 kernels per layer (16 ms for 120 tokens of a 1.5B model on
an H100, of which the GPU works 2 ms), while as rows of a graph it costs one replay. Everything
else (long prefill chunks, CPU) runs eagerly with the prefill kernel.
"""

from __future__ import annotations

import logging

import torch

from llmaccel.engine.cuda_graph import CUDAGraphRunner
from llmaccel.engine.scheduler import SchedulerOutput
from llmaccel.engine.sequence import Sequence
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.transformer import TransformerForCausalLM
from llmaccel.spec.tree import sibling_positions

logger = logging.getLogger(__name__)

# The most tokens of one sequence a step may run as separate decode rows (see `execute`):
# enough for a verify step of 15 drafts; longer runs (prefill chunks) use the prefill kernel.
DECODE_ROWS_MAX = 16
# A step of longer runs still replays a decode graph, one row per token, while it fits the
# largest graph and its rows read at most this many bytes of K/V per layer: row j of a run
# attends over the first start + j + 1 positions by itself, so the reads grow with the square
# of a prompt's length, where the prefill kernel reads each key tile once per query tile. On
# an H200, rows reading up to 302 MB per layer (a 3B model,
# 128 new tokens after 512 cached) still took 5.2 ms against 10.1 ms eagerly: the eager path
# spends ~0.3 ms of host time per layer, which pays for ~1 GB of K/V reads per layer at the
# ~3 TB/s the rows reached. 512 MiB keeps a margin for slower memory (0: never).
PREFILL_ROWS_KV_BYTES = 512 << 20
# Chained draft steps (cuda_graph.py: k - 1 greedy steps in one graph) for draft steps of up
# to this many rows; larger draft batches loop over single-step graphs (their GPU time, not
# the host's launches, bounds them). SpeculativeConfig.draft_chain=False turns chains off.
CHAIN_MAX_ROWS = 64


class ModelRunner:
    def __init__(self, model: TransformerForCausalLM, kv_caches: list[torch.Tensor],
                 block_size: int, max_model_len: int = 0,
                 cudagraph_capture_sizes: list[int] | None = None,
                 chain_steps: int = 0, chain_topk: int = 1,
                 tree_rows: bool = False) -> None:
        """`chain_steps`: a draft's runner also captures chained greedy steps of 1 to this
        many steps (`execute_chain`), with each step's top `chain_topk` tokens where that is
        above 1 (tree drafts, spec/tree.py). `tree_rows`: the target of tree verification;
        its decode rows read their newest key from their own slot
        (AttentionMetadata.newest_key_from_slot), in its graphs too."""
        self.model = model
        self.kv_caches = kv_caches
        # Copy-on-write moves FP8 blocks as bytes: torch's float8 indexing is patchy by device.
        self._copy_views = [c.view(torch.uint8) if c.element_size() == 1 else c
                            for c in kv_caches]
        self.block_size = block_size
        self.device = next(model.parameters()).device
        model.bind_kv_caches(kv_caches)
        self.prefill_rows_kv_bytes = PREFILL_ROWS_KV_BYTES
        # K/V bytes one layer reads per attended position
        cache = kv_caches[0] if kv_caches else None
        self._kv_bytes_per_key = (0 if cache is None else
                                  2 * cache.shape[-2] * cache.shape[-1] * cache.element_size())
        self.graphs: CUDAGraphRunner | None = None
        self.ran_graph = False  # whether the last `execute` replayed a CUDA graph
        if self.device.type == "cuda" and getattr(model.model.norm, "use_triton", False):
            from llmaccel.kernels import pdl
            pdl.configure(self.device)  # before capture: graphs keep the launch attributes
        if cudagraph_capture_sizes and self.device.type == "cuda":
            if not model.attention_backend.supports_cuda_graphs:
                logger.warning("attention backend '%s' cannot be captured in CUDA graphs; "
                               "decode runs eagerly", model.attention_backend.name)
            else:
                self.graphs = CUDAGraphRunner(model, cudagraph_capture_sizes,
                                              -(-max_model_len // block_size), self.device,
                                              block_size, tree_rows)
                self.graphs.capture()
                if chain_steps > 0:
                    self.graphs.capture_chains(chain_steps, CHAIN_MAX_ROWS, chain_topk)
        self.tree_rows = tree_rows
        self.chain_topk = chain_topk

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks before a sequence writes into its copy."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self._copy_views:
            cache[:, dst] = cache[:, src]
        features = self.model.feature_cache  # a draft head's inputs, kept by slot
        if features is not None:
            offsets = torch.arange(self.block_size, device=self.device)
            features[(dst[:, None] * self.block_size + offsets).flatten()] = features[
                (src[:, None] * self.block_size + offsets).flatten()]

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Tree verification (spec/tree.py): each (src, dst) pair's KV, in every layer, and
        its feature (a draft head's input) copied from slot src to slot dst: an accepted
        sibling's, to the slot of its position."""
        if not moves:
            return
        # one transfer from pinned memory, queued: a pageable copy would wait for the work
        # already on the stream (the next round's overlapped drafts) every accepted round
        idx = torch.tensor(moves, dtype=torch.long).T.contiguous()
        if self.device.type == "cuda":
            idx = idx.pin_memory()
        src, dst = idx.to(self.device, non_blocking=True)
        for cache in self._copy_views:
            flat = cache.view(2, -1, *cache.shape[-2:])  # [2, slots, kv_heads, d]
            flat[:, dst] = flat[:, src]
        features = self.model.feature_cache
        if features is not None:
            features[dst] = features[src]

    def can_chain(self, num_rows: int, steps: int) -> bool:
        """Whether `execute_chain` serves `steps` chained steps of `num_rows` rows."""
        return self.graphs is not None and self.graphs.can_chain(num_rows, steps)

    @torch.inference_mode()
    def execute_chain(self, seqs: list, counts: list[int], first_ids: torch.Tensor,
                      steps: int, starts: torch.Tensor | None = None) -> torch.Tensor:
        """`steps` greedy single-token steps of each of `seqs` in one launch (no host work in
        between): seqs[i] feeds first_ids[i] (on the device) at its num_computed_tokens (or
        at starts[i], positions on the device), then its own argmaxes, writing KV for
        counts[i] <= steps positions (allocated by the caller) -> the argmaxes [steps,
        len(seqs)] (float64). The caller advances num_computed_tokens."""
        if starts is None:
            starts = [s.num_computed_tokens for s in seqs]
        return self.graphs.run_chain(starts, counts, [s.block_table for s in seqs], first_ids,
                                     steps)

    def can_run_on_device(self, num_rows: int) -> bool:
        """Whether `execute_on_device` serves a step of `num_rows` rows."""
        return self.graphs is not None and self.graphs.can_run(num_rows)

    @torch.inference_mode()
    def execute_on_device(self, seqs: list, ids: torch.Tensor, positions: torch.Tensor,
                          write: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """A decode-rows step whose ids and positions are on the device (one row per entry of
        `seqs`, a sequence may repeat; KV written where `write`), in the graph runner's
        static buffers -> greedy [2, len(rows)] of the asked rows (spec/overlap.py)."""
        self.ran_graph = True
        return self.graphs.run_on_device(ids, positions, write,
                                         [s.block_table for s in seqs], rows)

    @torch.inference_mode()
    def execute_prepared(self, seqs: list, prepare):
        """A decode-rows step (one row per entry of `seqs`, a sequence may repeat) whose
        inputs `prepare(inputs, seq_lens, block_tables)` writes on the device into the graph
        runner's static buffers -> (prepare's result, greedy [2, rows] of every row)."""
        self.ran_graph = True
        return self.graphs.run_prepared([s.block_table for s in seqs], prepare)

    def _small_step_as_rows(self, step: SchedulerOutput) -> bool:
        """Whether a step with a longer run (a prefill chunk) still runs as decode rows in a
        CUDA graph: it fits one, and its rows' K/V reads stay within the budget."""
        if self.graphs is None or self.prefill_rows_kv_bytes <= 0:
            return False
        if not self.graphs.can_run(sum(n for _, n in step.scheduled)):
            return False
        # row j of a run starting at s attends over s + j + 1 positions
        keys = sum(n * seq.num_computed_tokens + n * (n + 1) // 2 for seq, n in step.scheduled)
        return keys * self._kv_bytes_per_key <= self.prefill_rows_kv_bytes

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, input_ids: torch.Tensor | None = None,
                drafts: tuple[torch.Tensor, dict[Sequence, int], int] | None = None
                ) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None]:
        """Launch the step (no host sync); returns the sequences that reached their last token
        (and so sample now), their next-token logits [rows, vocab] (one row per sequence, or
        1 + len(seq.spec_token_ids) rows for one with speculative drafts) and, from a CUDA
        graph, the greedy tokens and logprobs [2, rows] computed inside it (else None).

        `input_ids` (on the device, any numeric dtype) replaces the ids of a step whose
        tokens the host does not know yet (async scheduling, a draft model's next step): one
        per scheduled token. `drafts` (ids [steps, rows] on the device, and the column of
        each sequence whose spec_token_ids are placeholders for them): a draft model's
        proposals the host has not seen, written into the input ids on the device; a third
        entry, the row of drafts[0] where sibling drafts start (spec/tree.py)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables, sampling, rows = [], [], [], [], []
        fresh: list[int] = []  # per row, the first position its sequence writes this step
        patch_dst: list[int] = []  # where in ids, and where in drafts[0].flatten(), the
        patch_src: list[int] = []  # device-resident drafts go
        columns, width = (drafts[1], drafts[0].shape[1]) if drafts is not None else ({}, 0)
        # A step that adds at most DECODE_ROWS_MAX tokens to each sequence (speculative
        # verification: the last token and k drafts; a draft model catching up) runs as
        # decode rows, one per token: token j of a sequence attends over its first
        # start + j + 1 positions, which is exactly the causal mask, so the decode kernel
        # (split-K over the context) and the decode CUDA graphs serve it.
        # Tree verification (spec/tree.py) needs decode rows: a step with sibling drafts runs
        # as rows whatever else it holds (eagerly where no graph fits).
        tree = any(seq.spec_sibling_ids for seq, _ in step.scheduled)
        as_rows = (tree or all(n <= DECODE_ROWS_MAX for _, n in step.scheduled)
                   or self._small_step_as_rows(step))
        sib_row0 = drafts[2] if drafts is not None else 0
        for seq, n in step.scheduled:
            start = seq.num_computed_tokens
            table = seq.block_table
            spec = seq.spec_token_ids  # speculative drafts follow the last real token
            sibs = seq.spec_sibling_ids  # and their siblings follow the drafts
            ns = len(sibs)
            if n == 1:  # decode: skip building per-token ranges
                ids.append(seq.token_at(start))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                if not spec and not sibs:
                    # a plain decode row (most rows of a large batch): the rest of the
                    # general case below without its list concatenations
                    if as_rows:
                        fresh.append(start)
                    query_lens.append(1)
                    seq_lens.append(start + 1)
                    tables.append(table)
                    if start + 1 == seq.num_tokens:
                        sampling.append(seq)
                        rows.append(len(ids) - 1)
                    continue
            else:
                ids += seq.token_slice(start, start + n - len(spec) - ns) + spec + sibs
                col = columns.get(seq) if spec else None
                if col is not None:
                    patch_dst += range(len(ids) - ns - len(spec), len(ids) - ns)
                    patch_src += range(col, col + width * len(spec), width)
                    if ns:
                        patch_dst += range(len(ids) - ns, len(ids))
                        patch_src += range(sib_row0 * width + col,
                                           (sib_row0 + ns) * width + col, width)
                positions += range(start, start + n - ns)
                if ns:
                    positions += sibling_positions(seq.num_tokens - 1, ns,
                                                   seq.spec_sibling_width)
                # a sibling's KV goes to the slot of its row in the step, after the chain's
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if as_rows:
                fresh += [start] * n
                query_lens += [1] * n
                seq_lens += range(start + 1, start + n - ns + 1)
                if ns:  # a sibling's context: its ancestors, then its own key (its slot)
                    seq_lens += [q + 1 for q in positions[-ns:]]
                tables += [table] * n
            else:
                query_lens.append(n)
                seq_lens.append(start + n)
                tables.append(table)
            if start + n == seq.num_tokens + len(spec) + ns:
                sampling.append(seq)
                # logits of the last real token and of every draft (to verify them)
                rows.extend(range(len(ids) - 1 - len(spec) - ns, len(ids)))
        if input_ids is not None and input_ids.shape[0] != len(ids):
            raise ValueError(f"input_ids has {input_ids.shape[0]} ids for {len(ids)} tokens")
        subset = len(rows) < len(ids)
        patch = (patch_src, patch_dst, drafts[0]) if patch_dst else None
        self.ran_graph = as_rows and self.graphs is not None and self.graphs.can_run(len(ids))
        if tree and not self.tree_rows:
            raise ValueError("a step with sibling drafts on a runner made without tree_rows")
        if self.graphs is not None and not self.ran_graph:
            self.graphs.flush_copy_out()  # an eager step: the copy the engine asked for first
        if self.ran_graph:
            if not rows:
                self.graphs.run(ids, positions, slots, seq_lens, tables, input_ids,
                                patch=patch, fresh=fresh)
                return [], torch.empty(0, 0, device=self.device), None
            return sampling, *self.graphs.run(ids, positions, slots, seq_lens, tables,
                                              input_ids, rows if subset else None, patch,
                                              fresh)
        meta = AttentionMetadata.build(query_lens, seq_lens, self.device, slots, tables)
        meta.newest_key_from_slot = tree
        ids_t = (torch.tensor(ids, device=self.device) if input_ids is None
                 else input_ids.to(device=self.device, dtype=torch.long))
        if patch is not None:
            ids_t[torch.tensor(patch_dst, device=self.device)] = drafts[0].reshape(-1)[
                torch.tensor(patch_src, device=self.device)].long()
        hidden = self.model(ids_t, torch.tensor(positions, device=self.device), meta)
        if not rows:
            return [], hidden.new_empty(0, 0), None
        if subset:
            hidden = hidden[torch.tensor(rows, device=self.device)]
        return sampling, self.model.compute_logits(hidden), None
