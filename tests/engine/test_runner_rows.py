"""A step of a few tokens per sequence runs as decode rows (ModelRunner.execute): the logits
must equal those of the same step run as varlen queries over the paged cache."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_model, tiny_configs

from llmaccel.engine import model_runner as mr
from llmaccel.engine.kv_cache import allocate_kv_caches
from llmaccel.engine.model_runner import ModelRunner
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.engine.scheduler import SchedulerOutput
from llmaccel.engine.sequence import Sequence
from llmaccel.models.config import make_model_config
from llmaccel.models.loader import get_model

BLOCK = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "llama"
    make_tiny_model(tiny_configs()["llama"], path)
    model = get_model(make_model_config(str(path), dtype="float32"), "cpu",
                      attention_backend="torch")
    return ModelRunner(model, allocate_kv_caches(model, 64, BLOCK, torch.float32,
                                                 torch.device("cpu")), BLOCK, 512)


def _seq(i: int, tokens: list[int], first_block: int) -> Sequence:
    seq = Sequence(f"r{i}", 0, tokens, SamplingParams(temperature=0))
    seq.block_table = list(range(first_block, first_block + 8))
    return seq


def _run(runner, seqs, new, max_rows):
    """Prefill every sequence but its last real token, then run that token and its drafts
    (new[i] tokens in all) in one step."""
    saved = mr.DECODE_ROWS_MAX
    try:
        mr.DECODE_ROWS_MAX = 1000
        for seq in seqs:
            spec, seq.spec_token_ids = seq.spec_token_ids, []
            seq.num_computed_tokens = 0
            runner.execute(SchedulerOutput([(seq, seq.num_tokens - 1)]))
            seq.num_computed_tokens = seq.num_tokens - 1
            seq.spec_token_ids = spec
        mr.DECODE_ROWS_MAX = max_rows
        sampling, logits, _ = runner.execute(SchedulerOutput(list(zip(seqs, new))))
    finally:
        mr.DECODE_ROWS_MAX = saved
    return sampling, logits


def test_verify_step_as_decode_rows_equals_varlen_attention(runner):
    rng = random.Random(0)
    seqs = [_seq(i, [rng.randrange(160) for _ in range(ln)], 8 * i)
            for i, ln in enumerate([9, 14, 5])]
    # the last token plus drafts of different lengths (the drafts are the tail tokens)
    for seq, k in zip(seqs, [3, 0, 2]):
        seq.spec_token_ids = seq.prompt_token_ids[-k:] if k else []
        seq.prompt_token_ids = seq.prompt_token_ids[:len(seq.prompt_token_ids) - k]
    new = [1 + len(s.spec_token_ids) for s in seqs]
    sampling_a, as_rows = _run(runner, seqs, new, max_rows=16)
    sampling_b, varlen = _run(runner, seqs, new, max_rows=0)
    assert sampling_a == sampling_b == seqs
    assert as_rows.shape == (sum(new), 160)
    torch.testing.assert_close(as_rows, varlen, rtol=1e-5, atol=1e-5)


def test_rows_of_an_unfinished_chunk_are_not_returned(runner):
    """A chunk that does not reach the sequence's end samples nothing; another that does
    returns only its last row."""
    rng = random.Random(1)
    a = _seq(0, [rng.randrange(160) for _ in range(12)], 0)
    b = _seq(1, [rng.randrange(160) for _ in range(7)], 8)
    for seq in (a, b):
        seq.num_computed_tokens = 0
    runner.execute(SchedulerOutput([(a, 6), (b, 4)]))
    a.num_computed_tokens, b.num_computed_tokens = 6, 4
    sampling, logits, _ = runner.execute(SchedulerOutput([(a, 3), (b, 3)]))
    assert sampling == [b] and logits.shape == (1, 160)


def test_prefill_chunk_as_decode_rows_equals_prefill_kernel_path(runner):
    """A prefill chunk after a cached prefix, run as one decode row per token (how a small
    prefill replays a CUDA graph on a GPU), gives the logits of the prefill path."""
    rng = random.Random(2)
    seqs = [_seq(i, [rng.randrange(160) for _ in range(ln)], 8 * i)
            for i, ln in enumerate([30, 11])]
    outs = []
    for max_rows in (1000, 0):
        saved = mr.DECODE_ROWS_MAX
        try:
            mr.DECODE_ROWS_MAX = 0  # the cached prefixes: prefill path
            for seq in seqs:
                seq.num_computed_tokens = 0
            runner.execute(SchedulerOutput([(seqs[0], 9), (seqs[1], 4)]))
            for seq, n in zip(seqs, (9, 4)):
                seq.num_computed_tokens = n
            mr.DECODE_ROWS_MAX = max_rows
            outs.append(runner.execute(SchedulerOutput([(seqs[0], 21), (seqs[1], 7)]))[1])
        finally:
            mr.DECODE_ROWS_MAX = saved
    assert outs[0].shape == (2, 160)
    assert all(torch.is_inference(o) for o in outs)  # execute runs under inference_mode
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


class _Graphs:
    """Stands in for CUDAGraphRunner where only the decision is tested."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows

    def can_run(self, n: int) -> bool:
        return n <= self.max_rows


def test_small_prefill_steps_choose_graph_rows_within_budget(runner):
    """On a GPU, a prefill step runs as graph rows when it fits the largest graph and its
    rows' K/V reads (quadratic in the run's length) stay within the budget."""
    a = _seq(0, list(range(40)), 0)
    per_key = runner._kv_bytes_per_key
    assert per_key == 2 * 2 * 16 * 4  # K and V, tiny llama: 2 kv heads x head dim 16, fp32
    saved = runner.graphs, runner.prefill_rows_kv_bytes
    try:
        assert not runner._small_step_as_rows(SchedulerOutput([(a, 40)]))  # no graphs (CPU)
        runner.graphs = _Graphs(64)
        runner.prefill_rows_kv_bytes = 820 * per_key  # 40 rows from 0 read 40 * 41 / 2 keys
        assert runner._small_step_as_rows(SchedulerOutput([(a, 40)]))
        runner.prefill_rows_kv_bytes = 819 * per_key
        assert not runner._small_step_as_rows(SchedulerOutput([(a, 40)]))
        a.num_computed_tokens = 30  # a cached prefix: 10 rows read 30 + 1 .. 30 + 10 keys
        runner.prefill_rows_kv_bytes = 355 * per_key
        assert runner._small_step_as_rows(SchedulerOutput([(a, 10)]))
        runner.prefill_rows_kv_bytes = 354 * per_key
        assert not runner._small_step_as_rows(SchedulerOutput([(a, 10)]))
        runner.graphs, runner.prefill_rows_kv_bytes = _Graphs(39), 1 << 30
        a.num_computed_tokens = 0
        assert not runner._small_step_as_rows(SchedulerOutput([(a, 40)]))  # no graph holds it
        runner.graphs, runner.prefill_rows_kv_bytes = _Graphs(64), 0
        assert not runner._small_step_as_rows(SchedulerOutput([(a, 40)]))  # turned off
    finally:
        runner.graphs, runner.prefill_rows_kv_bytes = saved
        a.num_computed_tokens = 0


def test_prefill_as_graph_rows_computes_the_head_on_the_sampled_rows_only(runner):
    """A prefill run as rows of a captured size from SUBSET_MIN_ROWS samples one row per
    sequence: the graph runner's head-on-SUBSET_ROWS-rows variant must give the logits of the
    prefill kernel path (here eagerly, the CPU stand-in for a replay)."""
    from cpu_graphs import graphs_on_cpu

    from llmaccel.engine import cuda_graph

    rng = random.Random(5)
    seqs = [_seq(i, [rng.randrange(160) for _ in range(ln)], 8 * i)
            for i, ln in enumerate([23, 9])]
    outs, saved_graphs = [], runner.graphs
    try:
        for use_graphs in (False, True):
            runner.graphs = graphs_on_cpu(runner, 0) if use_graphs else None
            for seq in seqs:
                seq.num_computed_tokens = 0
            saved = mr.DECODE_ROWS_MAX
            try:
                mr.DECODE_ROWS_MAX = 1000 if use_graphs else 0
                sampling, logits, greedy = runner.execute(
                    SchedulerOutput([(seqs[0], 23), (seqs[1], 9)]))
            finally:
                mr.DECODE_ROWS_MAX = saved
            assert sampling == seqs and logits.shape == (2, 160)
            if use_graphs:
                bs = 32  # 32 rows: the smallest captured size that holds them
                assert runner.ran_graph and bs in runner.graphs.subset_outputs
                assert bs not in runner.graphs.outputs  # the all-rows variant never ran
                assert runner.graphs.subset_outputs[bs][0].shape[0] == cuda_graph.SUBSET_ROWS
                assert torch.equal(greedy[0].long(), logits.argmax(-1))
            outs.append(logits)
    finally:
        runner.graphs = saved_graphs
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_graph_rows_stage_where_each_sequence_starts_writing(runner):
    """The graph runner's kv_fresh_from row (what the decode attention may read before its
    PDL wait): for every row, the first position its sequence writes this step, so rows of a
    prompt run all get the run's start and a decode row its own position; padding rows 0."""
    from cpu_graphs import graphs_on_cpu

    from llmaccel.engine.cuda_graph import KV_FRESH_ROW

    rng = random.Random(6)
    seqs = [_seq(i, [rng.randrange(160) for _ in range(ln)], 8 * i)
            for i, ln in enumerate([30, 11])]
    saved_graphs, saved = runner.graphs, mr.DECODE_ROWS_MAX
    try:
        runner.graphs = graphs_on_cpu(runner, 0)
        mr.DECODE_ROWS_MAX = 1000
        for seq, n in zip(seqs, (9, 4)):
            seq.num_computed_tokens = n
        runner.execute(SchedulerOutput([(seqs[0], 21), (seqs[1], 7)]))
        fresh = runner.graphs.inputs[KV_FRESH_ROW]
        meta = runner.graphs._meta(32)
        assert meta.kv_fresh_from.data_ptr() == fresh.data_ptr()
        assert fresh[:28].tolist() == [9] * 21 + [4] * 7 and not fresh[28:32].any()
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens - 1
        runner.execute(SchedulerOutput([(seqs[0], 1), (seqs[1], 1)]))
        assert fresh[:2].tolist() == [29, 10]
    finally:
        runner.graphs, mr.DECODE_ROWS_MAX = saved_graphs, saved
        for seq in seqs:
            seq.num_computed_tokens = 0
