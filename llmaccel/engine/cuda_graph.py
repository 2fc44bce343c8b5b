"""CUDA graphs for decode steps: one captured graph per row count, replayed with new inputs.

A decode step of a small model is a few hundred kernel launches whose CPU cost exceeds their
GPU time; replaying a graph is one launch. Inputs live in static device buffers that every
graph reads; a step copies its rows into them (one kernel that reads the pinned host buffers,
`kernels/stage_inputs.py`, or else three small host-to-device copies), pads them up to the
next captured size and replays. Padding rows write nothing
(slot -1) and attend over one token of a valid block, so they cost little and touch nothing.
Graphs share one memory pool and are captured largest first, so they reuse the same memory.

A row is one token with its own position, slot, context length and block table, so a step of
a few tokens per sequence (speculative verification, a draft model's catch-up) replays these
graphs too: ModelRunner gives each token its own row (see model_runner.py).

The pinned host inputs are double-buffered: a draft model replays several steps without a
host sync, and the host must not overwrite inputs whose copy the device has not made yet; each
buffer waits on the event recorded after its last copy before it is rewritten.

Chained decode (`capture_chains`, `run_chain`): a draft's k - 1 single-token steps as ONE graph.
Each step's greedy token is the next step's input id, and positions, context lengths and KV
slots advance on the device (slot = block_table[pos // block_size] * block_size + pos %
block_size), so the host prepares and launches one replay per round instead of k - 1. For a
one-layer draft head (0.2-0.3 ms of GPU per step on an H100) that cut a round by 8-11%; a
0.5B draft model's GPU-bound steps gained nothing.
Rows draft different counts (adaptive k): a row past its count writes no KV (slot -1) and
re-reads its last position; its later outputs are ignored.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging

import torch

from llmaccel.kernels.greedy_select import greedy_with_logprobs
from llmaccel.kernels.stage_inputs import StagedCopy
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.transformer import TransformerForCausalLM

logger = logging.getLogger(__name__)



# A step that samples few of its rows (a short prefill run as rows: one row per sequence)
# replays a second graph of its size that computes the LM head and greedy for SUBSET_ROWS
# rows only, not for every row: W1's 128-token prompt on llama-3.2-3b ran the head over 128
# rows, a 128 x 128256 x 3072 product (the largest one of the int4 prefill). Captured for sizes from SUBSET_MIN_ROWS (smaller graphs' heads cost
# little).
SUBSET_ROWS = 8
SUBSET_MIN_ROWS = 32


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256, then every 64: padding wastes at most 16 rows
    (or 64 beyond 256) while keeping the number of graphs (and capture time) small."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(320, 1025, 64)]
    capped = [s for s in sizes if s < max_num_seqs]
    return capped + [max_num_seqs] if max_num_seqs <= 1024 else capped


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int, warmup: int = 1) -> float:
    """Mean GPU time (ms) of one replay of `graph`, `iters` replays back to back after
    `warmup` untimed ones (CUDA events around the loop)."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


_PROCESS_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector collected first, then off until the block ends.

    During a stream capture (global mode, torch's default) a CUDA call the capture forbids,
    from this thread too, invalidates it. The collector runs when allocations pass its
    thresholds, so it can run in the middle of a capture, and what it frees then, a dead
    engine held by reference cycles (pinned host buffers whose events are queried, graphs
    destroyed), makes such calls. torch.cuda.graph no longer collects before capturing
    (torch.compiler.config.force_cudagraph_gc is off by default). On an H200,
    test processes that built a second engine after dropping the first failed 1 in 3 runs
    while capturing the head's graphs: CUBLAS_STATUS_INTERNAL_ERROR / EXECUTION_FAILED
    from an fp32 GEMM inside the capture, then cudaErrorStreamCaptureInvalidated; never
    under CUDA_LAUNCH_BLOCKING=1, which changes the timing."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _process_capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The capture stream every runner of the process uses on `device` (the default)."""
    stream = _PROCESS_CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _PROCESS_CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


# Rows of the static int64 inputs: ids, positions, slots, sampled rows, patch sources, patch
# targets, for chained decode each row's first position and step count, and the first
# position each row's sequence writes this step (AttentionMetadata.kv_fresh_from; 0 where the
# caller does not say: the attention then reads all K/V after its PDL wait).
INPUT_ROWS = 9
KV_FRESH_ROW = 8


def _maybe_pin(t: torch.Tensor, pin: bool) -> torch.Tensor:
    return t.pin_memory() if pin else t


class _HostStaging:
    """One set of pinned host inputs (written through numpy views: no per-element torch
    overhead) and the event after their last copy to the device."""

    def __init__(self, n: int, w: int) -> None:
        # ids, positions, slots, sampled rows, patch sources and targets, chain starts and
        # counts, K/V fresh-from positions (int64); seq lens, tables (int32). Pinned where
        # there is a GPU to copy to (CPU runs use the chain eagerly: tests).
        pin = torch.cuda.is_available()
        self.inputs = _maybe_pin(torch.zeros(INPUT_ROWS, n, dtype=torch.long), pin)
        self.seq_lens = _maybe_pin(torch.ones(n, dtype=torch.int32), pin)
        self.tables = _maybe_pin(torch.zeros(n, w, dtype=torch.int32), pin)
        self.np_inputs, self.np_seq_lens, self.np_tables = (
            self.inputs.numpy(), self.seq_lens.numpy(), self.tables.numpy())
        # The table list each host row holds and how many of its entries are written there.
        # The block manager never edits a table in place (it appends, or makes a new list),
        # so a row whose list is the same object only needs the appended entries; holding
        # the reference keeps the object's identity from being reused.
        self.rows: list[tuple[list[int] | None, int]] = [(None, 0)] * n
        self.copied: torch.cuda.Event | None = None
        self.staged: StagedCopy | None = None  # the one-kernel copy to the device, if any


class CUDAGraphRunner:
    def __init__(self, model: TransformerForCausalLM, capture_sizes: list[int],
                 max_blocks_per_seq: int, device: torch.device, block_size: int = 16,
                 tree_rows: bool = False) -> None:
        self.model = model
        # tree verification: rows read their newest key from their own slot (spec/tree.py)
        self.tree_rows = tree_rows
        self.sizes = sorted(set(capture_sizes))
        self.max_bs = self.sizes[-1]
        self.device = device
        self.block_size = block_size
        n, w = self.max_bs, max_blocks_per_seq
        # Static device inputs: the INPUT_ROWS int64 rows and seq lens, tables (int32).
        self.inputs = torch.zeros(INPUT_ROWS, n, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._staging = [_HostStaging(n, w), _HostStaging(n, w)]
        for st in self._staging:  # one kernel launch per step instead of four copies
            if StagedCopy.available((st.inputs, st.seq_lens, st.tables), device):
                st.staged = StagedCopy((st.inputs, st.seq_lens, st.tables),
                                       (self.inputs, self.seq_lens, self.block_tables))
        self._flip = 0
        # (src on the device, pinned dst, event): a copy the next launch makes first
        # (`copy_out_next`)
        self._copy_out: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the head-on-SUBSET_ROWS-rows variants, per size from SUBSET_MIN_ROWS
        self.subset_sizes = {bs for bs in self.sizes if bs >= SUBSET_MIN_ROWS}
        self.subset_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.subset_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._row_index = torch.arange(n, device=device)
        # chained decode: graphs and their draft ids [steps, rows] per (rows, steps)
        self.chain_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.chain_outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.chain_sizes: list[int] = []
        self.chain_steps = 0
        # tree drafts: each chained step's runners-up too (`_chain_forward`), and the last
        # chain's, [steps * (topk - 1), rows] (`last_chain_siblings`)
        self.chain_topk = 1
        self.last_chain_siblings: torch.Tensor | None = None
        self.last_rows_siblings: torch.Tensor | None = None  # run_on_device's, [rows, w]

    def _meta(self, bs: int, seq_lens: torch.Tensor | None = None,
              slots: torch.Tensor | None = None) -> AttentionMetadata:
        """The static buffers' metadata of a bs-row decode step (or a chained step's own
        context lengths and slots: `_chain_rows`)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs] if seq_lens is None else seq_lens,
            slot_mapping=self.inputs[2, :bs] if slots is None else slots,
            block_tables=self.block_tables[:bs],
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs,
            max_query_len=1, max_seq_len=None, kv_fresh_from=self.inputs[KV_FRESH_ROW, :bs],
            newest_key_from_slot=self.tree_rows)

    def _forward(self, bs: int, subset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's logits and greedy tokens: of all bs rows, or (subset > 0) of the rows
        listed in inputs[3, :subset]."""
        hidden = self.model(self.inputs[0, :bs], self.inputs[1, :bs], self._meta(bs))
        if subset:
            hidden = hidden.index_select(0, self.inputs[3, :subset])
        logits = self.model.compute_logits(hidden)
        # Greedy sampling rides along in the graph: most decode batches need nothing else.
        return logits, greedy_with_logprobs(logits, use_kernel=True)

    def _chain_forward(self, bs: int, steps: int) -> torch.Tensor:
        """`steps` greedy decode steps of bs rows, each fed the last one's tokens -> the
        tokens [steps, bs] (float64, exact ids), followed with chain_topk > 1 by each step's
        runners-up: row steps + s * (topk - 1) + r holds step s's (r + 2)-th best token (tree
        drafts, spec/tree.py). Row r starts at position inputs[6, r] with input id
        inputs[0, r] and writes KV for its first inputs[7, r] steps only."""
        w = self.chain_topk - 1
        out = torch.empty(steps * (1 + w), bs, dtype=torch.float64, device=self.device)
        # positions, lengths and slots of every step, computed once
        rows = self._chain_rows(bs, steps)
        for s in range(steps):
            positions, lens, slots = rows[0][s], rows[1][s], rows[2][s]
            hidden = self.model(self.inputs[0, :bs], positions, self._meta(bs, lens, slots))
            if not w:
                # the step's tokens straight into its output row and the next input ids
                self.model.greedy_draft_into(hidden, out[s], self.inputs[0, :bs])
                self.model.prepare_chained_step(bs)
                continue
            # tokens and runners-up only (no logprobs), a head's over its draft vocabulary
            tokens, ups = self.model.greedy_draft(hidden, w)
            out[s].copy_(tokens)
            if w:
                out[steps + s * w:steps + (s + 1) * w].copy_(ups.T)
            self.inputs[0, :bs].copy_(tokens)  # float64 ids -> int64, exact
            self.model.prepare_chained_step(bs)
        return out

    def _chain_rows(self, bs: int, steps: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every chained step's positions, context lengths and KV slots at once, [steps, bs]
        each, as `_place_rows` gives them step by step: one set of small kernels per chain
        instead of one per step (on an H200 a chained head step of the 1.5B spent ~25 of its
        ~120 us in such kernels)."""
        start, count = self.inputs[6, :bs], self.inputs[7, :bs]
        done = torch.arange(1, steps + 1, device=self.device)[:, None]  # steps taken, s + 1
        # a row past its count stays on its last written position (valid KV to attend)
        pos = start - 1 + torch.minimum(count, done)
        block = self.block_size
        blocks = self.block_tables[self._row_index[:bs], pos // block].long()
        slots = torch.where(count > done - 1, blocks * block + pos % block, -1)
        return pos, (pos + 1).to(self.seq_lens.dtype), slots

    def _place_rows(self, n: int, pos: torch.Tensor, write: torch.Tensor) -> None:
        """Rows 0..n-1 at positions `pos` (on the device): their positions, context lengths
        and KV slots (block_table[pos // block_size] * block_size + pos % block_size where
        `write`, else -1: no cache write) into the static inputs, on the device."""
        block = self.block_size
        self.inputs[1, :n].copy_(pos)
        self.seq_lens[:n].copy_(pos + 1)
        blocks = self.block_tables[self._row_index[:n], pos // block].long()
        self.inputs[2, :n].copy_(torch.where(write, blocks * block + pos % block, -1))

    @torch.inference_mode()
    def capture(self) -> None:
        self.inputs[2].fill_(-1)  # capture-time runs must not write into the cache
        self._pool = torch.cuda.graph_pool_handle()
        with gc_paused():
            for bs in reversed(self.sizes):
                self.graphs[bs], self.outputs[bs] = self._capture_one(
                    lambda: self._forward(bs))
            self.inputs[3].zero_()  # the subset graphs' sampled rows: valid during capture
            for bs in sorted(self.subset_sizes, reverse=True):
                self.subset_graphs[bs], self.subset_outputs[bs] = self._capture_one(
                    lambda: self._forward(bs, SUBSET_ROWS))
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode row counts %s (and with the LM head on "
                    "%d rows for %s)", self.sizes, SUBSET_ROWS, sorted(self.subset_sizes))

    def _capture_one(self, fn):
        """One warm-up run of `fn` (Triton compiles, cuBLAS picks its kernels), then its
        graph in the shared pool -> (graph, fn's outputs as captured).

        Every graph of every runner in the process is captured on one side stream per device:
        on an H100 a 0.5B model's batch-1 decode graph replayed 10% slower when captured on
        a stream of its own or one per runner (0.99 and 1.00 against 0.91 ms), though its
        kernels were the same (docs/performance.md)."""
        stream = self._capture_stream = _process_capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            outputs = fn()
        return graph, outputs

    @torch.inference_mode()
    def capture_chains(self, max_steps: int, max_rows: int, topk: int = 1) -> None:
        """Chained-decode graphs of 1..max_steps steps for the captured row counts up to
        max_rows (on the CPU nothing is captured: `run_chain` runs the same steps eagerly),
        keeping each step's top `topk` tokens (tree drafts)."""
        self.chain_sizes = [bs for bs in self.sizes if bs <= max_rows]
        self.chain_steps = max_steps
        self.chain_topk = topk
        if self.device.type != "cuda" or max_steps < 1:
            return
        # capture-time runs write nothing: every row has a count of 0 (slot -1)
        self.inputs[6].fill_(1)
        self.inputs[7].fill_(0)
        with gc_paused():
            for bs in reversed(self.chain_sizes):
                for steps in range(1, max_steps + 1):
                    graph, out = self._capture_one(lambda: self._chain_forward(bs, steps))
                    self.chain_graphs[bs, steps], self.chain_outputs[bs, steps] = graph, out
        torch.cuda.synchronize(self.device)
        logger.info("captured chained-decode graphs of 1-%d steps for row counts %s",
                    max_steps, self.chain_sizes)

    @torch.inference_mode()
    def time_replays(self, iters: int = 3) -> dict[int, float]:
        """Replay time (ms) of each captured graph, with rows that write nothing (slot -1) and
        attend over one token: what a step of that many rows costs in weights and launches
        (attention over long contexts comes on top)."""
        self.inputs[2].fill_(-1)
        self.seq_lens.fill_(1)
        return {bs: replay_ms(self.graphs[bs], iters) for bs in self.sizes}

    def can_run(self, num_rows: int) -> bool:
        return num_rows <= self.max_bs

    def can_chain(self, num_rows: int, steps: int) -> bool:
        return (1 <= steps <= self.chain_steps and bool(self.chain_sizes)
                and num_rows <= self.chain_sizes[-1])

    def _next_staging(self) -> _HostStaging:
        """The host buffer set to fill now, once the device has read its last contents."""
        st = self._staging[self._flip]
        self._flip ^= 1
        if st.copied is not None:
            st.copied.synchronize()
        return st

    def _stage_tables(self, st: _HostStaging, tables: list[list[int]]) -> None:
        held_rows = st.rows
        for i, table in enumerate(tables):
            held, done = held_rows[i]
            if held is not table:
                done = 0
            if done < len(table):
                st.np_tables[i, done:len(table)] = table[done:]
                held_rows[i] = (table, len(table))
        # Stale table entries beyond a row's length are never read (positions < seq_len only).

    def _copy_in(self, st: _HostStaging, bs: int) -> None:
        """The staged inputs to the static device buffers (asynchronously)."""
        self.inputs.copy_(st.inputs, non_blocking=True)
        self.seq_lens.copy_(st.seq_lens, non_blocking=True)
        self.block_tables[:bs].copy_(st.tables[:bs], non_blocking=True)
        self._record_copied(st)

    def _record_copied(self, st: _HostStaging) -> None:
        if self.device.type == "cuda":
            if st.copied is None:
                st.copied = torch.cuda.Event()
            st.copied.record()

    def copy_out_next(self, src: torch.Tensor, dst: torch.Tensor,
                      event: torch.cuda.Event) -> None:
        """Copy `src` (a graph's output) into pinned `dst` before the next launch overwrites
        it, recording `event` after the copy: inside the next step's input kernel where that
        can take it (no copy of its own on the stream), else as a copy first. Every launch
        path makes it (`flush_copy_out`), so `event` is always recorded before the next
        launch returns."""
        self.flush_copy_out()
        self._copy_out = (src, dst, event)

    def flush_copy_out(self) -> None:
        """Make a pending `copy_out_next` copy now, in stream order."""
        if self._copy_out is not None:
            src, dst, event = self._copy_out
            self._copy_out = None
            dst.copy_(src, non_blocking=True)
            event.record()

    def run_chain(self, starts: list[int] | torch.Tensor, counts: list[int],
                  tables: list[list[int]], first_ids: torch.Tensor, steps: int) -> torch.Tensor:
        """`steps` chained greedy decode steps (see `_chain_forward`) of len(counts) rows: row
        r feeds first_ids[r] (on the device) at position starts[r] (a list, or a tensor on
        the device: positions the host does not know yet), and its tokens at the next
        positions, writing KV for counts[r] <= steps of them -> tokens [steps, rows] (a view of
        the graph's output, valid until its next replay)."""
        self.flush_copy_out()
        n = len(counts)
        bs = self.chain_sizes[bisect.bisect_left(self.chain_sizes, n)]
        st = self._next_staging()
        inp = st.np_inputs
        on_device = isinstance(starts, torch.Tensor)
        inp[6, :n], inp[7, :n] = 1 if on_device else starts, counts
        inp[6, n:bs], inp[7, n:bs], inp[0, n:bs] = 1, 0, 0  # padding rows write nothing
        inp[KV_FRESH_ROW, :bs] = 0  # every step of the chain writes: read K/V after the wait
        self._stage_tables(st, tables)
        self._stage_in(st, bs, tables, first_ids)
        if on_device:
            self.inputs[6, :n].copy_(starts)
        graph = self.chain_graphs.get((bs, steps))
        if graph is None:  # CPU: the same steps, eagerly
            out = self._chain_forward(bs, steps)
        else:
            graph.replay()
            out = self.chain_outputs[bs, steps]
        self.last_chain_siblings = out[steps:, :n] if self.chain_topk > 1 else None
        return out[:steps, :n]

    def run_on_device(self, ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
                      tables: list[list[int]], rows: torch.Tensor) -> torch.Tensor:
        """One decode step over len(tables) rows whose ids and positions are on the device
        (computed from a step the host has not seen: spec/overlap.py) -> greedy [2, m] of the
        m `rows` asked for. A row writes its KV only where `write` is true; its slot and
        context length follow from its position and block table, on the device."""
        n = len(tables)

        def prepare(inputs, seq_lens, block_tables):
            inputs[0, :n].copy_(ids)  # float64 ids -> int64, exact
            self._place_rows(n, positions.long(), write)

        _, greedy = self.run_prepared(tables, prepare)
        if self.chain_topk > 1:  # tree drafts: the asked rows' runners-up too
            bs = self.sizes[bisect.bisect_left(self.sizes, n)]
            self.last_rows_siblings = self.model.runners_up(
                self.outputs[bs][0].index_select(0, rows), self.chain_topk - 1)
        return greedy.index_select(1, rows)

    def run_prepared(self, tables: list[list[int]], prepare):
        """One decode step over len(tables) rows whose ids, positions, slots and context
        lengths `prepare(inputs, seq_lens, block_tables)` writes on the device, after the
        tables are staged (a draft head's overlapped catch-up: kernels/overlap_inputs.py)
        -> (prepare's result, the step's greedy [2, bs] of all rows, a view)."""
        self.flush_copy_out()
        n = len(tables)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        st = self._next_staging()
        inp = st.np_inputs
        inp[0, n:bs], inp[1, n:bs], inp[2, n:bs] = 0, 0, -1  # padding rows: no cache writes
        inp[KV_FRESH_ROW, :bs] = 0  # positions the host does not know: K/V after the wait
        st.np_seq_lens[n:bs] = 1
        self._stage_tables(st, tables)
        self._stage_in(st, bs, tables)
        result = prepare(self.inputs, self.seq_lens, self.block_tables)
        graph = self.graphs.get(bs)
        if graph is None:  # CPU (tests): the captured step's work, eagerly
            self.outputs[bs] = self._forward(bs)
        else:
            graph.replay()
        return result, self.outputs[bs][1]

    def _stage_in(self, st: _HostStaging, bs: int, tables: list[list[int]],
                  ids: torch.Tensor | None = None) -> None:
        """The staged inputs to the device, `ids` (on the device) into inputs[0, :len(ids)]
        and a pending `copy_out_next` copy, in one launch where the kernel can take them:
        the previous step's tokens out to the host (the engine's greedy [2, m] into its
        pinned buffer: StagedCopy checks them), inputs, seq lens, the tables' used columns
        and the ids in. Else the copy first, then torch's copies."""
        out = self._copy_out
        if st.staged is not None and (ids is None or (
                ids.dim() == 1 and ids.is_contiguous()
                and ids.dtype in (torch.int64, torch.float64, torch.int32))):
            self._copy_out = None
            st.staged(bs, max(1, max(map(len, tables), default=1)), ids,
                      None if out is None else out[:2])
            self._record_copied(st)
            if out is not None:
                out[2].record()
        else:
            self.flush_copy_out()
            self._copy_in(st, bs)
            if ids is not None:
                self.inputs[0, :ids.shape[0]].copy_(ids)  # float64 ids -> int64, exact

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            seq_lens: list[int], tables: list[list[int]],
            device_ids: torch.Tensor | None = None, rows: list[int] | None = None,
            patch: tuple[list[int], list[int], torch.Tensor] | None = None,
            fresh: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over len(ids) rows -> (logits [m, vocab], greedy [2, m]) (see
        `greedy_with_logprobs`) of the m `rows` asked for (default: all, as views of the
        graph's outputs, valid until the next replay; a subset is gathered into new tensors).
        `device_ids` [n] (on the device) replaces `ids`: e.g. the previous step's argmax,
        copied into the static input in stream order, before the replay overwrites it.
        `patch` (src, dst, values): ids[dst[i]] = values.flatten()[src[i]] on the device
        (drafts the host has not seen yet: ModelRunner.execute). `fresh` [n]: per row, the
        first position its sequence writes this step (a decode row: its own position; rows of
        one prompt run: the run's start); the attention reads K/V below it before its PDL
        wait. None: after the wait."""
        n = len(ids)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        st = self._next_staging()
        inp = st.np_inputs
        inp[0, :n], inp[1, :n], inp[2, :n] = ids, positions, slots
        inp[0, n:bs], inp[1, n:bs], inp[2, n:bs] = 0, 0, -1  # padding rows: no cache writes
        inp[KV_FRESH_ROW, :n] = 0 if fresh is None else fresh
        inp[KV_FRESH_ROW, n:bs] = 0
        m = n if rows is None else len(rows)
        if rows is not None:
            inp[3, :m] = rows
            inp[3, m:bs] = 0  # a subset graph reads SUBSET_ROWS of them
        if patch is not None:
            d = len(patch[0])
            inp[4, :d], inp[5, :d] = patch[0], patch[1]
        st.np_seq_lens[:n] = seq_lens
        st.np_seq_lens[n:bs] = 1
        self._stage_tables(st, tables)
        self._stage_in(st, bs, tables, device_ids)
        if patch is not None:
            values = patch[2].reshape(-1).index_select(0, self.inputs[4, :d]).long()
            self.inputs[0].index_copy_(0, self.inputs[5, :d], values)
        if rows is not None and m <= SUBSET_ROWS and bs in self.subset_sizes:
            # the head on the asked rows only (their index padded with row 0 above)
            graph = self.subset_graphs.get(bs)
            if graph is None:  # CPU (tests): the captured step's work, eagerly
                self.subset_outputs[bs] = self._forward(bs, SUBSET_ROWS)
            else:
                graph.replay()
            logits, greedy = self.subset_outputs[bs]
            return logits[:m].clone(), greedy[:, :m].clone()
        graph = self.graphs.get(bs)
        if graph is None:  # CPU (tests): the captured step's work, eagerly
            self.outputs[bs] = self._forward(bs)
        else:
            graph.replay()
        logits, greedy = self.outputs[bs]
        if rows is None:
            return logits[:n], greedy[:, :n]
        index = self.inputs[3, :m]
        return logits.index_select(0, index), greedy.index_select(1, index)
