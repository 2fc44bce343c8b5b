"""Overlapped drafting (spec/overlap.py): the next round's drafts launched with this round's
verify step, their inputs computed on the device. On the CPU the graph runner's code runs
eagerly (tests/cpu_graphs.py), which is what these tests use:

- every round drafts exactly the tokens a round drafted after verification drafts (fixed k),
  outputs stay the target's greedy tokens, and every block of both pools comes back, also with
  prefix caching, chunked prefill and preemption on;
- stops inside accepted drafts (drafts dropped when the running set changes), aborts while
  drafts are in flight and adaptive k stay lossless, and every block comes back;
- the device-side inputs of one launch against a hand computation;
- draft_overlap=False turns it off; a GPU variant runs under CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from cpu_graphs import graphs_on_cpu
from engine_matrix import hf_greedy, random_workload
from tiny_models import make_tiny_model, tiny_configs

from llmaccel import LLM, SamplingParams

K = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target, a draft that is the target with noise (agrees often, not always), and a
    random workload with transformers' greedy outputs."""
    target_dir = tmp_path_factory.mktemp("overlap-target")
    draft_dir = tmp_path_factory.mktemp("overlap-draft")
    hf = make_tiny_model(tiny_configs()["llama"], target_dir, seed=2)
    draft = make_tiny_model(tiny_configs()["llama"], draft_dir, seed=2)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std().clamp_min(1e-3))
    draft.save_pretrained(draft_dir)
    prompts, max_tokens = random_workload(hf.config.vocab_size, seed=3)
    return str(target_dir), str(draft_dir), prompts, max_tokens, hf_greedy(hf, prompts,
                                                                           max_tokens)


def _engine(target: str, draft: str, overlap: bool, monkeypatch, adaptive: bool = False,
            **kw) -> LLM:
    overlap_cfg = {"draft_overlap": overlap}
    spec = {"method": "draft", "model": draft, "num_speculative_tokens": K,
            "adaptive": adaptive}
    llm = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=4,
              speculative_config={**spec, **overlap_cfg}, **kw)
    width = -(-llm.engine.model_config.max_model_len // 4)  # block-table entries per row
    graphs_on_cpu(llm.engine.spec.draft.runner, K - 1, width)
    return llm


def _record(llm) -> list:
    """(context, drafts) of every drafting sequence at each verify."""
    spec, rounds = llm.engine.spec, []
    verify = spec.verify

    def recording(seqs, *args, **kw):
        for s in seqs:
            rounds.append((s.request_id, s.token_slice(0, s.num_tokens), list(s.spec_token_ids)))
        return verify(seqs, *args, **kw)

    spec.verify = recording
    return rounds


def _generate(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _all_back(llm) -> None:
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.spec.draft.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["default", "all-three"])
def test_overlapped_rounds_draft_what_rounds_after_verification_draft(pair, mode,
                                                                      monkeypatch):
    target, draft, prompts, max_tokens, expected = pair
    extra = ({} if mode == "default" else
             {"max_num_batched_tokens": 32, "num_gpu_blocks": 96, "max_model_len": 384})
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    runs = {}
    for overlap in (False, True):
        llm = _engine(target, draft, overlap, monkeypatch, enable_prefix_caching=True, **extra)
        rounds = _record(llm)
        outs = _generate(llm, prompts, params)
        _all_back(llm)
        runs[overlap] = outs, sorted(rounds), llm
    (plain_out, plain_rounds, off), (out, rounds, on) = runs[False], runs[True]
    assert out == plain_out == expected
    assert rounds == plain_rounds
    assert off.engine.spec.num_overlapped == 0
    # (a mixed workload: most rounds share their step with a prefill or a waiting request,
    # and draft after verification; the batch-1 test below counts the steady case)
    assert on.engine.spec.num_overlapped >= 5, on.engine.spec.num_overlapped
    stats = on.get_stats()
    if mode == "all-three":
        assert stats.num_preemptions > 0 and stats.prefix_hit_rate > 0
    spec = stats.spec_decode
    assert spec["num_accepted_tokens"] > 0 and spec["num_rollbacks"] > 0, spec


def test_single_request_overlaps_every_round_but_its_first_and_last(pair, monkeypatch):
    """Batch 1, long output: all rounds but the first and those near max_tokens are drafted
    during the previous round, the same drafts as after verification, with rounds where all
    k drafts were accepted (the catch-up writes the KV of draft k) and rounds with rejections
    (it writes only the bonus token's)."""
    target, draft, prompts, _, _ = pair
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True)
    want = _generate(plain, prompts[:1], params)
    runs = []
    for overlap in (False, True):
        llm = _engine(target, draft, overlap, monkeypatch)
        rounds = _record(llm)
        assert _generate(llm, prompts[:1], params) == want
        _all_back(llm)
        runs.append((rounds, llm))
    (plain_rounds, _), (rounds, llm) = runs
    assert rounds == plain_rounds
    spec = llm.engine.spec
    assert spec.num_overlapped >= len(rounds) - 1 - (K + 1), (spec.num_overlapped, len(rounds))
    assert spec.num_overlap_dropped == 0
    stats = llm.get_stats().spec_decode
    full = stats["accepted_per_position"][K - 1]  # rounds that accepted all k drafts
    assert 0 < full < len(rounds) and stats["num_rollbacks"] > 0, stats


def test_stops_inside_accepted_drafts_drop_the_drafts_launched_for_them(pair, monkeypatch):
    """A request stopping at a stop id changes the running set: the drafts launched for the
    others are dropped and their draft KV booked back; the rounds after that draft what they
    draft without overlap."""
    target, draft, prompts, max_tokens, expected = pair
    params = []
    for toks, m in zip(expected, max_tokens):
        stop = toks[len(toks) // 2]  # a token the greedy output does produce
        params.append(SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                                     stop_token_ids=[stop]))
    runs = []
    for overlap in (False, True):
        llm = _engine(target, draft, overlap, monkeypatch)
        rounds = _record(llm)
        runs.append((_generate(llm, prompts, params), sorted(rounds), llm))
        _all_back(llm)
    (plain_out, plain_rounds, _), (out, rounds, llm) = runs
    assert out == plain_out
    assert rounds == plain_rounds
    assert llm.engine.spec.num_overlapped > 0
    assert llm.engine.spec.num_overlap_dropped > 0


def test_adaptive_k_stays_lossless(pair, monkeypatch):
    """With adaptive k the next round's k is chosen before this round's acceptance is known,
    so drafts may differ from rounds without overlap; outputs may not."""
    target, draft, prompts, max_tokens, expected = pair
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm = _engine(target, draft, True, monkeypatch, adaptive=True)
    assert _generate(llm, prompts, params) == expected
    assert llm.engine.spec.num_overlapped > 0
    _all_back(llm)


def test_sampled_requests_are_not_overlapped(pair, monkeypatch):
    """Sampled drafts come from q on the host's choice of rows: such rounds draft after
    verification, and the output is the seeded output without overlap."""
    target, draft, prompts, _, _ = pair
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    outs = []
    for overlap in (False, True):
        llm = _engine(target, draft, overlap, monkeypatch)
        outs.append(_generate(llm, prompts[:2], params))
        assert llm.engine.spec.num_overlapped == 0
        _all_back(llm)
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_overlap_under_cuda_graphs(pair, monkeypatch):
    """On the GPU the engine captures its graphs itself (fp32): overlapped rounds replay the
    decode and chain graphs with inputs computed on the device."""
    target, draft, prompts, max_tokens, _ = pair
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    spec = {"method": "draft", "model": draft, "num_speculative_tokens": K, "adaptive": False,
            # keep speculating: the measured costs would switch this tiny pair off
            "auto_disable": False, "draft_cost_ratio": 0.0}
    runs = []
    for overlap in (False, True):
        overlap_cfg = {"draft_overlap": overlap}
        llm = LLM(target, dtype="float32", device="cuda", skip_tokenizer_init=True,
                  enable_prefix_caching=True, speculative_config={**spec, **overlap_cfg})
        # every runner captures on the process's one stream (another stream replayed 10%
        # slower on an H100: docs/performance.md)
        assert (llm.engine.runner.graphs._capture_stream
                is llm.engine.spec.draft.runner.graphs._capture_stream is not None)
        rounds = _record(llm)
        outs = _generate(llm, prompts, params)
        one = _generate(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=60,
                                                         ignore_eos=True))
        _all_back(llm)
        runs.append((outs, one, sorted(rounds), llm.engine.spec.num_overlapped))
    (plain_out, plain_one, plain_rounds, none), (out, one, rounds, overlapped) = runs
    assert none == 0 and overlapped > 10, overlapped
    assert out == plain_out
    assert one == plain_one
    # graphs of other row counts may round differently: near-ties can flip a draft's argmax
    same = sum(a == b for a, b in zip(rounds, plain_rounds))
    assert same >= 0.9 * max(len(rounds), len(plain_rounds)), same


def test_aborts_while_drafts_are_launched_return_every_block(pair, monkeypatch):
    """Requests aborted while the next round's drafts are in flight (between steps, as a
    server does): the others finish with plain decoding's tokens, and both pools get every
    block back."""
    target, draft, prompts, _, _ = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True)
    want = _generate(plain, prompts[:3], params)
    llm = _engine(target, draft, True, monkeypatch)
    engine = llm.engine
    for i, p in enumerate(prompts[:3]):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 6:
            assert engine.spec.lookahead is not None  # drafts in flight
            engine.abort_request("1")
        if steps == 9:
            engine.abort_request("2")
    assert done["0"] == want[0]
    assert "1" not in done and "2" not in done
    assert engine.spec.num_overlapped > 0 and engine.spec.num_overlap_dropped > 0
    _all_back(llm)


class _RecordingRunner:
    """Stands in for a draft's ModelRunner: records what launch_lookahead hands it."""

    def __init__(self):
        self.rows = self.chain = None

    def can_run_on_device(self, n):
        return True

    def can_chain(self, n, steps):
        return True

    def execute_on_device(self, seqs, ids, positions, write, rows):
        self.rows = (seqs, ids.tolist(), positions.tolist(), write.tolist(), rows.tolist())
        first = torch.tensor([500.0 + r for r in range(len(rows))], dtype=torch.float64)
        return torch.stack([first, torch.zeros_like(first)])

    def execute_chain(self, seqs, counts, first_ids, steps, starts=None):
        self.chain = (counts, first_ids.tolist(), steps, starts.tolist())
        return torch.arange(steps * len(seqs), dtype=torch.float64).view(steps, len(seqs))


def test_lookahead_inputs_follow_each_rows_acceptance():
    """launch_lookahead's device-side inputs against a hand computation: per sequence the
    accepted count a, the two catch-up rows (the token at p + a writing KV only when all k
    were accepted, then the bonus token), and the chain from p + a + 2 for k' - 1 steps."""
    from types import SimpleNamespace

    from llmaccel.engine.sequence import Sequence
    from llmaccel.engine.sampling_params import SamplingParams as SP
    from llmaccel.spec.draft_model import DeviceDrafts
    from llmaccel.spec.overlap import launch_lookahead

    class _Blocks:
        def allocate_slots(self, view, n):
            return True

    seqs = []
    for i, prompt in enumerate(([1, 2, 3], [4, 5], [6, 7, 8, 9])):
        s = Sequence(str(i), 0, list(prompt), SP(temperature=0))
        s.draft_view = SimpleNamespace(seq=s)
        seqs.append(s)
    ks = [3, 2, 3]  # drafts this round; verify rows: k + 1 each, in order
    # drafts [steps, columns]: the columns are 2, 0, 1 for the sequences
    drafts = {0: [11, 12, 13], 1: [21, 22], 2: [31, 32, 33]}
    cols = {seqs[0]: 2, seqs[1]: 0, seqs[2]: 1}
    ids = torch.zeros(3, 3, dtype=torch.float64)
    for i, s in enumerate(seqs):
        for j, d in enumerate(drafts[i]):
            ids[j, cols[s]] = d
    # the target's argmax per verify row: seq 0 accepts 1 (then 99), seq 1 accepts both
    # (bonus 77), seq 2 accepts none (bonus 55)
    argmax = [11, 99, 0, 0] + [21, 22, 77] + [55, 0, 0, 0]
    greedy = torch.tensor([argmax, [0.0] * len(argmax)], dtype=torch.float64)
    from llmaccel.spec.draft_model import DraftModelProposer

    runner = _RecordingRunner()
    proposer = DraftModelProposer.__new__(DraftModelProposer)
    proposer.runner, proposer.block_manager = runner, _Blocks()
    proposer._to_host = lambda out, columns, topk=1: (out.clone(), columns)
    out, columns = launch_lookahead(proposer, seqs, ks, [4, 2, 1], greedy, [0, 4, 7],
                                    DeviceDrafts(ids, cols, ids, None))
    _, row_ids, positions, write, rows = runner.rows
    p = [s.num_tokens - 1 for s in seqs]  # 2, 1, 3
    a = [1, 2, 0]
    assert row_ids == [11, 99, 22, 77, 9, 55]  # [token at p + a, bonus] per sequence
    assert positions == [p[0] + 1, p[0] + 2, p[1] + 2, p[1] + 3, p[2], p[2] + 1]
    assert write == [False, True, True, True, False, True]  # only seq 1 accepted all k
    assert rows == [1, 3, 5]
    counts, first, steps, starts = runner.chain
    assert counts == [3, 1, 0] and steps == 3 and first == [500.0, 501.0, 502.0]
    assert starts == [p[i] + a[i] + 2 for i in range(3)]
    assert out.shape == (4, 3) and out[0].tolist() == [500.0, 501.0, 502.0]
    assert columns == {seqs[0]: 0, seqs[1]: 1, seqs[2]: 2}


def test_lookup_first_with_overlap_drafts_as_without(pair, monkeypatch):
    """ngram_first with overlap, one request at a time: a draft model's round launched during
    the last one is used unless lookup finds a match (then dropped: lookup drafts first), so
    every round drafts what it drafts without overlap and outputs stay the target's greedy
    tokens, with every block back."""
    target, draft, prompts, _, _ = pair
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True)
    want = [_generate(plain, [p], params)[0] for p in prompts[:2]]
    runs = {}
    for overlap in (False, True):
        overlap_cfg = {"draft_overlap": overlap}
        spec = {"method": "draft", "model": draft, "num_speculative_tokens": K,
                "adaptive": False, "ngram_first": True, "prompt_lookup_min": 1,
                "prompt_lookup_num_tokens": 6}
        llm = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
                  block_size=4, speculative_config={**spec, **overlap_cfg})
        graphs_on_cpu(llm.engine.spec.draft.runner, K - 1,
                      -(-llm.engine.model_config.max_model_len // 4))
        rounds = _record(llm)
        assert [_generate(llm, [p], params)[0] for p in prompts[:2]] == want
        _all_back(llm)
        runs[overlap] = sorted(rounds), llm.engine.spec
    (off_rounds, off), (on_rounds, on) = runs[False], runs[True]
    assert on_rounds == off_rounds
    assert on.num_ngram_first == off.num_ngram_first > 0
    assert off.num_overlapped == 0
    assert on.num_overlapped > 0 and on.num_overlap_dropped > 0, (on.num_overlapped,
                                                                   on.num_overlap_dropped)
