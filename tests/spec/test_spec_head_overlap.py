"""Overlapped drafting with a draft head (spec/overlap.py, HeadProposer.overlap_catch_up): the
next round's catch-up (k + 1 rows per sequence from the target's features of the verify step)
and chain launched behind the verify step. On the CPU the graph runner's code runs eagerly
(tests/cpu_graphs.py):

- every round drafts exactly what the head's definition drafts from the target's features
  (an independent transformers computation), the same drafts as without overlap, outputs are
  the target's greedy tokens, and every block of both pools comes back, also with prefix
  caching, chunked prefill and preemption;
- the catch-up's device-side inputs against a hand computation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cpu_graphs import graphs_on_cpu
from test_spec_head import MODES, _record_rounds, reference_drafts
from tiny_models import make_echo_head_pair

from llmaccel import LLM, SamplingParams

K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """tiny_models.make_echo_head_pair: rounds accept all k drafts, some, or none (a random
    head accepts nothing, and the catch-up's rows past a would go untested)."""
    d = tmp_path_factory.mktemp("head-overlap")
    hf, tensors = make_echo_head_pair(d)
    return d, hf, tensors


def _engine(d, overlap: bool, monkeypatch, **kw) -> LLM:
    overlap_cfg = {"draft_overlap": overlap}
    spec = {"method": "head", "model": str(d / "head"), "num_speculative_tokens": K,
            "adaptive": False}
    llm = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
              block_size=16, speculative_config={**spec, **overlap_cfg}, **kw)
    width = -(-llm.engine.model_config.max_model_len // 16)
    graphs_on_cpu(llm.engine.spec.draft.runner, K - 1, width)
    return llm


@pytest.mark.parametrize("mode", list(MODES))
def test_overlapped_head_rounds_draft_the_reference(pair, mode, monkeypatch):
    d, hf, tensors = pair
    base = [11, 12, 13, 14, 15] * 12
    prompts = [base + [3, 4], base + [7], [5, 6, 7, 8] * 3, list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                block_size=16, **MODES[mode])
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    runs = {}
    for overlap in (False, True):
        llm = _engine(d, overlap, monkeypatch, **MODES[mode])
        rounds = _record_rounds(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert llm.engine.block_manager.num_used_blocks == 0
        assert llm.engine.spec.draft.block_manager.num_used_blocks == 0
        runs[overlap] = sorted(rounds), llm.engine.spec, llm.get_stats()
    (off_rounds, off, _), (on_rounds, on, stats) = runs[False], runs[True]
    # (rounds that share their step with a prefill or a waiting request draft after
    # verification: the steady rounds later on overlap)
    assert off.num_overlapped == 0 and on.num_overlapped >= 5, on.num_overlapped
    if mode != "plain":
        assert stats.prefix_hit_rate > 0 and stats.num_preemptions > 0
    assert on_rounds == off_rounds
    for context, drafts in on_rounds:
        assert drafts == reference_drafts(hf, tensors, context, len(drafts)), len(context)


def test_single_request_overlaps_every_round(pair, monkeypatch):
    """Batch 1, long output: all rounds but the first and those near max_tokens are launched
    during the previous round, with rounds that accept all k drafts (the catch-up writes all
    k + 1 rows) and rounds with rejections (it writes 1 + accepted)."""
    d, hf, tensors = pair
    prompt = [11, 12, 13, 14, 15] * 6 + [3, 4]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = _engine(d, True, monkeypatch)
    rounds = _record_rounds(llm)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    spec = llm.engine.spec
    # not overlapped: the first round, and rounds within 2k + 1 tokens of max_tokens (the
    # next round's k must fit if all k are accepted), at least one token each
    assert spec.num_overlapped >= len(rounds) - 1 - (2 * K + 1), (spec.num_overlapped,
                                                                   len(rounds))
    assert spec.num_overlap_dropped == 0
    for context, drafts in rounds:
        assert drafts == reference_drafts(hf, tensors, context, len(drafts)), len(context)
    stats = llm.get_stats().spec_decode
    full = stats["accepted_per_position"][K - 1]
    assert 0 < full < len(rounds) and stats["num_rollbacks"] > 0, stats
    assert spec.draft.block_manager.num_used_blocks == 0


class _RecordingRunner:
    def __init__(self, head):
        self.head, self.call = head, None

    def execute_on_device(self, seqs, ids, positions, write, rows):
        n = len(seqs)
        self.call = (seqs, ids.tolist(), positions.tolist(), write.tolist(), rows.tolist(),
                     self.head.static_features[:n, 0].tolist())
        # the head's outputs: row r's output is r + 100 in every column
        self.head.static_out[:n] = (torch.arange(n, dtype=torch.float32) + 100)[:, None]
        first = torch.tensor([500.0 + r for r in rows.tolist()], dtype=torch.float64)
        return torch.stack([first, torch.zeros_like(first)])


@pytest.mark.parametrize("prev_token", [False, True])
def test_head_catch_up_inputs_follow_each_rows_acceptance(prev_token):
    """HeadProposer.overlap_catch_up against a hand computation: k + 1 rows per sequence at
    head positions p..p + k, the token at p + j + 1 (drafts below a, then the bonus), the
    target's features read at the verify step's slots, KV written for j <= a, row a's output
    as the chain's first feature, and the chain from p + a + 1. A prev_token head also gets
    the token at p + j (t0, then the rows' own ids shifted), and row a's id for the chain."""
    from llmaccel.spec.head_proposer import HeadProposer
    from llmaccel.spec.overlap import AcceptedOnDevice

    hidden = 4
    prev_ids: list[list[int]] = []
    head = SimpleNamespace(static_features=torch.zeros(16, hidden),
                           static_out=torch.zeros(16, hidden),
                           fuse_target_features=lambda f: f,  # no aux layers
                           prev_token=prev_token,
                           set_prev_ids=lambda ids: prev_ids.append(ids.tolist()))
    feature_cache = torch.arange(64, dtype=torch.float32)[:, None].repeat(1, hidden)
    proposer = HeadProposer.__new__(HeadProposer)
    proposer.model = SimpleNamespace(model=head)
    proposer.target = SimpleNamespace(feature_cache=feature_cache)
    proposer.runner = _RecordingRunner(head)
    proposer.block_manager = SimpleNamespace(block_size=4)
    # two sequences: k = 3 (accepts 1, bonus 99) and k = 2 (accepts both, bonus 77)
    seqs = [SimpleNamespace(num_tokens=6, block_table=[7, 2, 9]),
            SimpleNamespace(num_tokens=3, block_table=[5, 1])]
    ks, kmax = [3, 2], 3
    meta = [proposer.overlap_catch_up_meta(s, k, kmax) for s, k in zip(seqs, ks)]
    # positions 5..8 in blocks [7, 2, 9] (block size 4), then 2..4 padded with the last
    assert meta == [[2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0], [5 * 4 + 2, 5 * 4 + 3,
                                                                   1 * 4 + 0, 1 * 4 + 0]]
    acc = AcceptedOnDevice(p=torch.tensor([5, 2]), t0=torch.tensor([40, 41]),
                           k=torch.tensor(ks), a=torch.tensor([1, 2]),
                           bonus=torch.tensor([99, 77]),
                           drafts=torch.tensor([[11, 12, 13], [21, 22, 22]]),
                           extra=torch.tensor(meta))
    views = ["v0", "v1"]
    first, starts = proposer.overlap_catch_up(views, acc)
    seen, ids, positions, write, rows, feats = proposer.runner.call
    assert seen == ["v0"] * 4 + ["v1"] * 4
    assert ids == [11, 99, 99, 99] + [21, 22, 77, 77]
    assert positions == [5, 6, 7, 8] + [2, 3, 4, 5]
    assert write == [True, True, False, False] + [True, True, True, False]
    assert rows == [1, 4 + 2]
    assert feats == [float(x) for x in meta[0] + meta[1]]
    assert first.tolist() == [501.0, 506.0]
    assert starts.tolist() == [5 + 1 + 1, 2 + 2 + 1]
    # the chain's first features: the catch-up's outputs at rows a
    assert head.static_features[:2, 0].tolist() == [101.0, 106.0]
    # the catch-up's tokens at p + j, then the chain's first: rows a's ids
    assert prev_ids == ([[40, 11, 99, 99, 41, 21, 22, 77], [99, 77]] if prev_token else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_head_overlap_under_cuda_graphs(pair, monkeypatch):
    """On the GPU the head's catch-up (k + 1 rows) and chain replay CUDA graphs with inputs
    computed on the device; in fp32 the rounds draft what rounds without overlap draft (near
    ties aside) and outputs stay the target's."""
    d, hf, tensors = pair
    base = [11, 12, 13, 14, 15] * 12
    prompts = [base + [3, 4], [5, 6, 7, 8] * 3, list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", skip_tokenizer_init=True, block_size=16,
              enable_prefix_caching=True)
    want = [o.outputs[0].token_ids for o in
            LLM(str(d / "target"), **kw).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "head", "model": str(d / "head"), "num_speculative_tokens": K,
            "adaptive": False, "auto_disable": False, "draft_cost_ratio": 0.0}
    runs = []
    for overlap in (False, True):
        overlap_cfg = {"draft_overlap": overlap}
        llm = LLM(str(d / "target"), speculative_config={**spec, **overlap_cfg}, **kw)
        assert llm.engine.spec.draft.runner.graphs is not None
        rounds = _record_rounds(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert llm.engine.block_manager.num_used_blocks == 0
        assert llm.engine.spec.draft.block_manager.num_used_blocks == 0
        runs.append((sorted(rounds), llm.engine.spec.num_overlapped))
    (off_rounds, none), (on_rounds, overlapped) = runs
    assert none == 0 and overlapped >= 5, overlapped
    same = sum(a == b for a, b in zip(on_rounds, off_rounds))
    assert same >= 0.9 * max(len(on_rounds), len(off_rounds)), same


@pytest.mark.parametrize("batch", [1, 3])
def test_lookup_first_drops_overlapped_drafts_where_lookup_matches(pair, monkeypatch, batch):
    """ngram_first with overlap: a head round's next round is launched during it, and dropped
    when lookup then finds a match (lookup drafts first); every round drafts what it drafts
    without overlap, outputs are the target's greedy tokens, and both pools' blocks come
    back. (The echo pair's outputs are runs of one token: lookup matches inside a run, the
    head drafts where a run starts.)"""
    d, hf, tensors = pair
    prompts = [[5, 6, 7, 8] * 3, list(range(30, 52)), [11, 12, 13, 14, 15] * 12 + [3, 4]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                block_size=16)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    groups = [prompts] if batch > 1 else [[p] for p in prompts]
    runs = {}
    for overlap in (False, True):
        overlap_cfg = {"draft_overlap": overlap}
        spec = {"method": "head", "model": str(d / "head"), "num_speculative_tokens": K,
                "adaptive": False, "ngram_first": True, "prompt_lookup_min": 2,
                "prompt_lookup_num_tokens": 5}
        llm = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                  block_size=16, speculative_config={**spec, **overlap_cfg})
        graphs_on_cpu(llm.engine.spec.draft.runner, K - 1,
                      -(-llm.engine.model_config.max_model_len // 16))
        rounds = _record_rounds(llm)
        got = [o.outputs[0].token_ids for g in groups
               for o in llm.generate(g, params, use_tqdm=False)]
        assert got == want
        assert llm.engine.block_manager.num_used_blocks == 0
        assert llm.engine.spec.draft.block_manager.num_used_blocks == 0
        runs[overlap] = sorted(rounds), llm.engine.spec
    (off_rounds, off), (on_rounds, on) = runs[False], runs[True]
    assert on_rounds == off_rounds
    assert on.num_ngram_first == off.num_ngram_first > 0
    assert off.num_overlapped == 0 and off.num_overlap_dropped == 0
    # batch 1: head rounds after head rounds ran overlapped, lookups after them dropped the
    # drafts (batch 3: a round where some sequences take lookup drafts launches nothing)
    assert on.num_overlap_dropped > 0
    if batch == 1:
        assert on.num_overlapped > 0
    for context, drafts in on_rounds:
        assert len(drafts) <= 5
