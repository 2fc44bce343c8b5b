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
