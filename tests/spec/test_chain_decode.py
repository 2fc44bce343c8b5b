"""Chained decode (engine/cuda_graph.py `run_chain`): k - 1 greedy draft steps in one launch.
On the CPU the graph runner runs the same code eagerly, which these tests use:

- the chained tokens equal single steps through ModelRunner.execute, row by row, each to its
  own count, and the KV cache changes exactly at the slots of each row's counted positions;
- a draft model and a draft head draft the same tokens in every round with chains as without
  (adaptive k: rows of one step draft different counts), outputs stay the target's greedy
  tokens, and every block comes back."""

from __future__ import annotations

import pytest
import torch
from cpu_graphs import graphs_on_cpu
from tiny_models import make_tiny_head, make_tiny_model, tiny_configs

from llmaccel import LLM, SamplingParams
from llmaccel.engine.block_manager import BlockManager
from llmaccel.engine.kv_cache import allocate_kv_caches
from llmaccel.engine.model_runner import ModelRunner
from llmaccel.engine.scheduler import SchedulerOutput
from llmaccel.engine.sequence import Sequence
from llmaccel.engine.sampling_params import SamplingParams as SP
from llmaccel.models.config import make_model_config
from llmaccel.models.loader import get_model

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("chain-target")
    make_tiny_model(tiny_configs()["llama"], d, seed=2)
    mc = make_model_config(str(d), dtype="float32")
    return str(d), get_model(mc, "cpu", attention_backend="torch")


def _runner(model, num_blocks=64):
    caches = allocate_kv_caches(model, num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    return ModelRunner(model, caches, BLOCK), BlockManager(num_blocks, BLOCK, False)


def _prefilled(runner, bm, prompts):
    seqs = []
    for i, p in enumerate(prompts):
        seq = Sequence(str(i), 0, list(p), SP(temperature=0, max_tokens=64))
        assert bm.allocate_slots(seq, len(p))
        seqs.append(seq)
    runner.execute(SchedulerOutput(scheduled=[(s, s.num_tokens) for s in seqs]))
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
    return seqs


def test_chained_steps_equal_single_steps_and_write_only_counted_slots(tiny):
    _, model = tiny
    prompts = [[3, 9, 27, 5, 8, 1, 44], [7, 7, 2], [60, 61, 62, 63, 64, 65, 66, 67, 68, 10, 4]]
    counts, steps = [3, 0, 1], 3
    first = torch.tensor([11.0, 22.0, 33.0], dtype=torch.float64)

    # reference: single eager steps, each row only for its count (then its next token only)
    runner, bm = _runner(model)
    seqs = _prefilled(runner, bm, prompts)
    want = [[] for _ in seqs]
    for r, seq in enumerate(seqs):
        token = int(first[r])
        for _ in range(counts[r]):
            seq.output_token_ids.append(token)
            assert bm.allocate_slots(seq, 1)
            _, logits, _ = runner.execute(SchedulerOutput(scheduled=[(seq, 1)]))
            seq.num_computed_tokens += 1
            token = int(logits[0].argmax())
            want[r].append(token)
    ref_cache = [c.clone() for c in runner.kv_caches]

    # chained: the same rows in one call, on a fresh cache with the same prefill
    runner, bm = _runner(model)
    seqs = _prefilled(runner, bm, prompts)
    before = [c.clone() for c in runner.kv_caches]
    for seq, c in zip(seqs, counts):
        assert bm.allocate_slots(seq, c) or c == 0
    graphs_on_cpu(runner, steps)
    assert runner.can_chain(3, steps) and not runner.can_chain(3, steps + 1)
    out = runner.execute_chain(seqs, counts, first, steps)
    assert out.shape == (steps, 3)
    for r, c in enumerate(counts):
        assert [int(t) for t in out[:c, r]] == want[r], r
    # exactly the counted positions' slots changed, to the reference's values
    written = set()
    for seq, c in zip(seqs, counts):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + c):
            written.add(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
    for after, old, ref in zip(runner.kv_caches, before, ref_cache):
        flat_after, flat_old = after.flatten(1, 2), old.flatten(1, 2)  # [2, slots, ...]
        changed = {int(s) for s in (flat_after != flat_old).flatten(2).any(-1).any(0)
                   .nonzero().flatten()}
        assert changed == written
        assert torch.allclose(flat_after[:, sorted(written)], ref.flatten(1, 2)[:, sorted(
            written)], atol=1e-5)


def _record(llm):
    """(context, drafts) of every drafting sequence at each verify, and the draft counts of
    every chained call."""
    spec = llm.engine.spec
    rounds, chains, verify = [], [], spec.verify
    runner = spec.draft.runner
    execute_chain = runner.execute_chain

    def recording(seqs, *args, **kw):
        for s in seqs:
            rounds.append((s.token_slice(0, s.num_tokens), list(s.spec_token_ids)))
        return verify(seqs, *args, **kw)

    def chained(seqs, counts, *args, **kw):
        chains.append(list(counts))
        return execute_chain(seqs, counts, *args, **kw)

    spec.verify, runner.execute_chain = recording, chained
    return rounds, chains


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny):
    target, _ = tiny
    d = tmp_path_factory.mktemp("chain-pairs")
    draft = make_tiny_model(tiny_configs()["llama"], d / "draft", seed=2)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():  # the target plus noise: agrees often, not always
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std().clamp_min(1e-3))
    draft.save_pretrained(d / "draft")
    make_tiny_head(tiny_configs()["llama"], d / "head", seed=4)
    return target, {"draft": str(d / "draft"), "head": str(d / "head")}


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["draft", "head"])
def test_chained_drafting_drafts_what_single_steps_draft(pairs, method, device, monkeypatch):
    """On the GPU the engine captures the chains itself (real CUDA graphs, fp32), and
    draft_chain=False gives the single-step graphs to compare with."""
    target, models = pairs
    base = [11, 12, 13, 14, 15] * 8
    prompts = [base + [3, 4], base + [7], [5, 6, 7, 8] * 3, list(range(30, 52)), [9, 2, 9]]
    # different lengths: k is cut near each request's end, so rows draft different counts
    # (as they do under adaptive k, which the draft model's pair also exercises; the random
    # head is rejected so often that adaptive k would leave it at 1)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (30, 23, 27, 19, 25)]
    spec = {"method": method, "model": models[method], "num_speculative_tokens": 4,
            "adaptive": method == "draft",
            # keep speculating on the GPU: the measured costs would switch these tiny pairs off
            "auto_disable": False, "draft_cost_ratio": 0.0}
    results = {}
    # rounds launched during the previous one (spec/overlap.py) pick k before the previous
    # round's acceptance: tests/spec/test_spec_overlap.py compares those
    for chained in (False, True):
        cfg = {**spec, "draft_overlap": False, "draft_chain": chained}
        llm = LLM(target, dtype="float32", device=device, skip_tokenizer_init=True,
                  block_size=BLOCK, enable_prefix_caching=True, speculative_config=cfg)
        if device == "cpu":
            graphs_on_cpu(llm.engine.spec.draft.runner, 3 if chained else 0)
        else:
            assert bool(llm.engine.spec.draft.runner.graphs.chain_graphs) == chained
        rounds, chains = _record(llm)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.block_manager.num_used_blocks == 0
        assert llm.engine.spec.draft.block_manager.num_used_blocks == 0
        results[chained] = outs, rounds, chains
    (plain_out, plain_rounds, none), (out, rounds, chains) = results[False], results[True]
    assert none == [] and len(chains) > 5
    # adaptive k: some chained calls had rows drafting different counts
    assert any(len(set(c)) > 1 for c in chains), chains
    assert out == plain_out
    if device == "cpu":
        assert rounds == plain_rounds
    else:  # graphs of other row counts may round differently: near-ties can flip an argmax
        same = sum(a == b for a, b in zip(rounds, plain_rounds))
        assert same >= 0.9 * max(len(rounds), len(plain_rounds)), same
