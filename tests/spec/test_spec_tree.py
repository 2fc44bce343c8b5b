"""Tree verification (spec/tree.py, SpeculativeConfig.draft_topk): a draft head's chain plus its
runners-up at each depth, verified as leaves.

- the host verification and its device twin (overlap) on hand-made rows;
- the decode kernel's newest key from the row's own slot, against a hand computation;
- in the engine (tiny echo pair: rounds accept all drafts, some, or none): outputs are the
  target's greedy tokens, siblings are accepted, every round's chain and siblings are what
  the head's definition gives (transformers features), with and without overlapped drafting
  (the CUDA-graph runner's code on the CPU), with prefix caching, chunked prefill and
  preemption; all blocks come back; without moving an accepted sibling's KV the outputs go
  wrong (so the move is what keeps them right);
- bad settings are clear errors."""

from __future__ import annotations

import pytest
import torch
from cpu_graphs import graphs_on_cpu
from test_spec_head import MODES, reference_head
from tiny_models import make_echo_head_pair

from llmaccel import LLM, SamplingParams
from llmaccel.errors import LLMAccelError
from llmaccel.kernels.attention_ref import paged_decode_attention_ref
from llmaccel.spec.config import SpeculativeConfig, SpeculativeConfigError
from llmaccel.spec.overlap import AcceptedOnDevice, _accept_siblings
from llmaccel.spec.tree import greedy_verify_tree, sibling_positions
from llmaccel.spec.verifier import greedy_verify_rows

K = 3


def test_greedy_verify_tree_by_hand():
    # one sequence, k = 3, width 2: rows 0..3 are t0, d1..d3; rows 4..9 the siblings
    chain, sibs = [5, 6, 7], [50, 51, 60, 61, 70, 71]
    #         t0 d1 d2 d3 | s1  s1' s2  s2' s3  s3'
    argmax = [5, 9, 0, 0, 0, 0, 33, 44, 0, 0]
    # d1 accepted; at depth 2 the target wants 9: no sibling is 9 -> a chain result
    assert greedy_verify_tree([chain], [sibs], [2], argmax, [0]) == ([[5, 9]], [1], [-1])
    # the target wants 61 at depth 2 (row 1): sibling 3 (61) is accepted, then its row's
    # argmax (row 4 + 3 = 7: 44)
    argmax[1] = 61
    assert greedy_verify_tree([chain], [sibs], [2], argmax, [0]) == ([[5, 61, 44]], [2], [3])
    # the first matching sibling wins; depth 1 rejected, sibling 0 (50) accepted
    tokens = greedy_verify_tree([chain], [[50, 50, 1, 1, 1, 1]], [2], [50, 1, 1, 1, 8, 9] +
                                [0] * 4, [0])
    assert tokens == ([[50, 8]], [1], [0])
    # all accepted: siblings play no part; offsets place a second sequence's rows
    argmax = [0] * 3 + [5, 6, 7, 42] + [0] * 6
    assert greedy_verify_tree([[1], chain], [[], sibs], [0, 2], argmax, [0, 3]) == (
        [[0], [5, 6, 7, 42]], [0, 3], [-1, -1])
    # without siblings it is the chain verification
    argmax = [4, 4, 2, 2, 9]
    assert greedy_verify_tree([[4, 4], [2]], [[], []], [0, 0], argmax, [0, 3])[:2] == (
        greedy_verify_rows([[4, 4], [2]], argmax, [0, 3]))
    assert sibling_positions(10, 6, 2) == [11, 11, 12, 12, 13, 13]


def test_device_sibling_acceptance_matches_the_host():
    """spec/overlap._accept_siblings (the next round's catch-up inputs) gives what the host's
    greedy_verify_tree gives, on random rows."""
    g = torch.Generator().manual_seed(0)
    n, kmax, w = 64, 3, 2
    for _ in range(5):
        ks = torch.randint(1, kmax + 1, (n,), generator=g)
        chains = torch.randint(0, 3, (n, kmax), generator=g)
        sibs = torch.randint(0, 3, (n, kmax, w), generator=g)
        target = torch.randint(0, 3, (n, kmax + 1), generator=g)
        target_sib = torch.randint(0, 3, (n, kmax, w), generator=g)
        valid = torch.arange(kmax)[None, :] < ks[:, None]
        a = ((chains == target[:, :kmax]) & valid).long().cumprod(1).sum(1)
        acc = AcceptedOnDevice(p=torch.zeros(n), t0=torch.zeros(n), k=ks, a=a,
                               bonus=target.gather(1, a[:, None])[:, 0], drafts=chains,
                               extra=torch.zeros(n, kmax + 1))
        slots = torch.arange(n * kmax * w).view(n, kmax, w)
        got = _accept_siblings(acc, target_sib, sibs, valid[:, :, None].expand(n, kmax, w),
                               slots)
        for b in range(n):
            k = int(ks[b])
            argmax = target[b, :k + 1].tolist() + target_sib[b, :k].flatten().tolist()
            (tokens,), (acc_b,), (pick,) = greedy_verify_tree(
                [chains[b, :k].tolist()], [sibs[b, :k].flatten().tolist()], [w], argmax, [0])
            assert int(got.a[b]) == acc_b and bool(got.sibling_hit[b]) == (pick >= 0)
            assert got.drafts[b, :acc_b].tolist() + [int(got.bonus[b])] == tokens
            if pick >= 0:
                assert int(got.sibling_slot[b]) == int(slots[b].flatten()[pick])


def _tree_case(device):
    """Two decode rows over one sequence's blocks: row 0 at its chain position, row 1 a
    sibling at the same position whose key sits in another slot."""
    gen = torch.Generator().manual_seed(3)
    block, heads, kv_heads, d = 4, 4, 2, 16
    cache = torch.randn(2, 6, block, kv_heads, d, generator=gen)
    table = [4, 1, 3]
    bt = torch.tensor([table, table], dtype=torch.int32)
    sl = torch.tensor([11, 11], dtype=torch.int32)  # position 10 is each row's newest key
    slots = torch.tensor([table[2] * block + 2, 5 * block + 1], dtype=torch.int64)
    q = torch.randn(2, heads, d, generator=gen)
    return [t.to(device) for t in (q, cache, bt, sl, slots)]


def _by_hand(q, cache, table, newest_slot, length, scale):
    block = cache.shape[2]
    slots = [table[p // block] * block + p % block for p in range(length - 1)] + [newest_slot]
    flat = cache.reshape(2, -1, *cache.shape[-2:])
    k, v = flat[0, slots], flat[1, slots]  # [L, kv_heads, d]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    w = torch.einsum("hd,lhd->hl", q, k) * scale
    return torch.einsum("hl,lhd->hd", w.softmax(-1), v)


@pytest.mark.parametrize("fresh", [None, 8])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_rows_read_their_newest_key_from_their_slot(num_splits, fresh):
    q, cache, bt, sl, slots = _tree_case("cpu")
    want = torch.stack([_by_hand(q[i], cache, bt[i].tolist(), int(slots[i]), 11, 0.25)
                        for i in range(2)])
    ref = paged_decode_attention_ref(q, cache, bt, sl, 0.25, last_slots=slots)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    # row 0's slot is its table's: the same as without last_slots; row 1's is not
    plain = paged_decode_attention_ref(q, cache, bt, sl, 0.25)
    torch.testing.assert_close(plain[0], want[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain[1], want[1], atol=1e-3)
    # -1: through the table
    torch.testing.assert_close(paged_decode_attention_ref(
        q, cache, bt, sl, 0.25, last_slots=torch.tensor([-1, -1])), plain)
    pytest.importorskip("triton")
    from llmaccel.kernels.paged_attention import paged_decode_attention
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, cache, bt, sl, slots = _tree_case(device)
    got = paged_decode_attention(q, cache, bt, sl, 0.25, num_splits=num_splits, block_n=16,
                                 last_slots=slots, kv_fresh_from=None if fresh is None else
                                 torch.tensor([fresh, fresh], device=device))
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("tree-pair")
    hf, tensors = make_echo_head_pair(d)
    return d, hf, tensors


@torch.no_grad()
def reference_tree(hf, t: dict, tokens: list[int], k: int, topk: int
                   ) -> tuple[list[int], list[int]]:
    """k greedy drafts after `tokens` (test_spec_head.reference_drafts) and at each depth the
    head's 2nd..topk-th best tokens."""
    ids = torch.tensor([tokens])
    feats = list(hf.model(ids).last_hidden_state[0, :-1])
    emb, lm = hf.model.embed_tokens.weight, hf.lm_head.weight
    toks = list(tokens[1:])
    drafts, sibs = [], []
    for _ in range(k):
        out = reference_head(t, hf.config, emb[torch.tensor(toks)], torch.stack(feats))[-1]
        top = (out @ lm.T).topk(topk).indices.tolist()
        drafts.append(top[0])
        sibs += top[1:]
        toks.append(top[0])
        feats.append(out)
    return drafts, sibs


def _record_tree_rounds(llm):
    spec = llm.engine.spec
    rounds, verify = [], spec.verify

    def recording(seqs, *args, **kw):
        for s in seqs:
            rounds.append((s.token_slice(0, s.num_tokens), list(s.spec_token_ids),
                           list(s.spec_sibling_ids)))
        return verify(seqs, *args, **kw)

    spec.verify = recording
    return rounds


def _engine(d, topk: int, overlap: bool, monkeypatch, **kw) -> LLM:
    overlap_cfg = {"draft_overlap": overlap}
    spec = {"method": "head", "model": str(d / "head"), "num_speculative_tokens": K,
            "adaptive": False, "draft_topk": topk}
    llm = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
              block_size=16, speculative_config={**spec, **overlap_cfg}, **kw)
    if overlap:  # the graph runner's code path (run eagerly): what overlap needs
        graphs_on_cpu(llm.engine.spec.draft.runner, K - 1,
                      -(-llm.engine.model_config.max_model_len // 16))
    return llm


PROMPTS = [[11, 12, 13, 14, 15] * 12 + [3, 4], [11, 12, 13, 14, 15] * 12 + [7],
           [5, 6, 7, 8] * 3, list(range(30, 52))]


@pytest.mark.parametrize("mode", list(MODES))
def test_tree_rounds_are_lossless_and_follow_the_reference(pair, mode, monkeypatch):
    d, hf, tensors = pair
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                block_size=16, **MODES[mode])
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    chain = _engine(d, 1, False, monkeypatch, **MODES[mode])
    assert [o.outputs[0].token_ids for o in chain.generate(PROMPTS, params,
                                                           use_tqdm=False)] == want
    chain_steps = chain.engine.spec.stats.num_steps
    runs = {}
    for overlap in (False, True):
        llm = _engine(d, 3, overlap, monkeypatch, **MODES[mode])
        rounds = _record_tree_rounds(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        spec = llm.engine.spec
        assert spec.num_tree_accepted >= 5, spec.num_tree_accepted
        assert spec.stats.num_steps < chain_steps  # siblings save verify steps
        with_siblings = [r for r in rounds if r[2]]
        assert len(with_siblings) >= 0.5 * len(rounds)
        for context, drafts, sibs in rounds:
            ref_drafts, ref_sibs = reference_tree(hf, tensors, context, len(drafts), 3)
            assert drafts == ref_drafts, len(context)
            assert sibs in ([], ref_sibs), len(context)
        assert llm.engine.block_manager.num_used_blocks == 0
        assert spec.draft.block_manager.num_used_blocks == 0
        runs[overlap] = (sorted(rounds), spec.num_overlapped)
    assert runs[False][1] == 0 and runs[True][1] >= 5
    assert runs[False][0] == runs[True][0]


def test_without_moving_accepted_siblings_outputs_go_wrong(pair, monkeypatch):
    """The accepted sibling's KV must reach its position's slot: with the move skipped the
    target attends over a rejected draft's KV there, and outputs leave greedy decoding."""
    d, _, _ = pair
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                block_size=16)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    llm = _engine(d, 3, False, monkeypatch)
    llm.engine.spec.move_slots = lambda moves: None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got != want


def test_tree_settings_are_checked(pair):
    d, _, _ = pair
    with pytest.raises(SpeculativeConfigError, match="draft_topk"):
        SpeculativeConfig(method="ngram", draft_topk=2)
    with pytest.raises(SpeculativeConfigError, match="draft_topk must be >= 1"):
        SpeculativeConfig(method="head", model="x", draft_topk=0)
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens \\* draft_topk"):
        SpeculativeConfig(method="head", model="x", num_speculative_tokens=4, draft_topk=4)
    with pytest.raises(SpeculativeConfigError, match="confidence"):
        SpeculativeConfig(method="head", model="x", draft_topk=2,
                          draft_confidence_threshold=0.5)
    with pytest.raises(LLMAccelError, match="triton or torch attention backend"):
        LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
            attention_backend="flex",
            speculative_config={"method": "head", "model": str(d / "head"), "draft_topk": 2})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True])
def test_tree_under_cuda_graphs_on_gpu(pair, monkeypatch, overlap):
    """On the GPU the target's verify graphs read siblings' keys from their slots (Triton),
    the head's chain graphs keep runners-up; in fp32 outputs stay the target's, siblings are
    accepted, rounds draft as the reference does (near ties aside)."""
    d, hf, tensors = pair
    overlap_cfg = {"draft_overlap": overlap}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", skip_tokenizer_init=True, block_size=16,
              enable_prefix_caching=True)
    want = [o.outputs[0].token_ids for o in
            LLM(str(d / "target"), **kw).generate(PROMPTS, params, use_tqdm=False)]
    spec = {"method": "head", "model": str(d / "head"), "num_speculative_tokens": K,
            "adaptive": False, "auto_disable": False, "draft_topk": 3}
    llm = LLM(str(d / "target"), speculative_config={**spec, **overlap_cfg}, **kw)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.tree_rows
    rounds = _record_tree_rounds(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    spec_dec = llm.engine.spec
    assert spec_dec.num_tree_accepted >= 5
    if overlap:
        assert spec_dec.num_overlapped >= 5
    same = sum((dr, sb) == reference_tree(hf, tensors, ctx, len(dr), 3) for ctx, dr, sb in rounds
               if sb)
    assert same >= 0.9 * sum(1 for r in rounds if r[2]), same
    assert llm.engine.block_manager.num_used_blocks == 0
