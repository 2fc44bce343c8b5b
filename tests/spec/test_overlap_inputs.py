"""The draft head's overlapped catch-up in two kernels (kernels/overlap_inputs.py,
HeadProposer.fused_catch_up) and the chain's positions computed once (CUDAGraphRunner.
_chain_rows):

- the Triton kernels (TRITON_INTERPRET=1 on the CPU) write what their torch references write,
  over random acceptances, batch sizes, k and hidden sizes;
- the reference against a hand computation (the same case as HeadProposer.overlap_catch_up's
  test in test_spec_head_overlap.py);
- engines with the fused catch-up on and off draft the same rounds, and the fused one is the
  path taken; chained drafting with positions placed once or step by step drafts the same."""

from __future__ import annotations

import pytest
import torch
from test_spec_head import _record_rounds
from test_spec_head_overlap import _engine, pair  # noqa: F401 (a fixture)

from llmaccel import SamplingParams
from llmaccel.kernels import overlap_inputs as oi

ROWS = 9  # the graph runner's int64 input rows
# the kernels on the GPU where there is one, else in Triton's interpreter (conftest.py)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(n: int, kmax: int, hidden: int, seed: int):
    """A random round: n sequences with k <= kmax drafts each, argmax rows where the first a
    drafts match (a random), meta as launch_lookahead builds it, tables, features."""
    g = torch.Generator().manual_seed(seed)
    width, bs, cols = kmax + 1, 4, 6
    ks = torch.randint(1, kmax + 1, (n,), generator=g).tolist()
    drafts = torch.randint(0, 50, (kmax, n), generator=g).double()  # [steps, columns]
    greedy, meta, o = [], [], 0
    for i, k in enumerate(ks):
        a = int(torch.randint(0, k + 1, (1,), generator=g))
        mine = drafts[:, i].long().tolist()
        rows = [mine[j] if j < a else 50 + j for j in range(k)] + [77 + i]
        greedy += rows
        p = int(torch.randint(3, 12, (1,), generator=g))
        slots = torch.randint(0, 40, (k + 1,), generator=g).tolist()
        meta.append([o + min(j, k) for j in range(kmax + 1)]
                    + [min(j, k - 1) * n + i for j in range(kmax)]
                    + [int(j < k) for j in range(kmax)]
                    + slots + [slots[-1]] * (kmax - k) + [p, 90 + i, k])
        o += k + 1
    meta = torch.tensor(meta, dtype=torch.long)
    assert meta.shape[1] == oi.meta_columns(kmax)
    r = n * width
    tables = torch.randint(0, 30, (r + 3, cols), generator=g, dtype=torch.int32)
    feat_src = torch.randn(40, hidden, generator=g)
    return dict(greedy=torch.tensor(greedy, dtype=torch.float64, device=DEV),
                drafts=drafts.reshape(-1).to(DEV), meta=meta.to(DEV), kmax=kmax,
                tables=tables.to(DEV), block_size=bs, feat_src=feat_src.to(DEV), r=r)


def _buffers(case, hidden: int, prev: bool):
    r = case["r"] + 3
    return dict(inputs=torch.full((ROWS, r), -7, dtype=torch.long, device=DEV),
                lens=torch.full((r,), -7, dtype=torch.int32, device=DEV),
                prev=torch.full((r,), -7, dtype=torch.long, device=DEV) if prev else None,
                feat_dst=torch.full((r, hidden), -7.0, device=DEV))


@pytest.mark.parametrize("n,kmax,hidden", [(1, 4, 8), (3, 3, 600), (2, 1, 40), (4, 5, 16)])
@pytest.mark.parametrize("prev", [False, True])
def test_catch_up_kernel_writes_what_the_reference_writes(n, kmax, hidden, prev):
    case = _case(n, kmax, hidden, seed=n * 10 + kmax)
    got, want = _buffers(case, hidden, prev), _buffers(case, hidden, prev)
    args = (case["greedy"], case["drafts"], case["meta"], kmax)
    rows, starts = oi.catch_up_inputs(*args, got["inputs"], got["lens"], case["tables"],
                                      case["block_size"], got["prev"], case["feat_src"],
                                      got["feat_dst"], use_kernel=True)
    rows_ref, starts_ref = oi.catch_up_inputs_ref(*args, want["inputs"], want["lens"],
                                                  case["tables"], case["block_size"],
                                                  want["prev"], case["feat_src"],
                                                  want["feat_dst"])
    assert rows.tolist() == rows_ref.tolist() and starts.tolist() == starts_ref.tolist()
    for name in ("inputs", "lens", "prev", "feat_dst"):
        if got[name] is not None:
            assert torch.equal(got[name], want[name]), name
    # rows past the catch-up's are untouched
    assert (got["inputs"][:, case["r"]:] == -7).all() and (got["inputs"][3:] == -7).all()
    # some rounds of the case accept nothing, others all their drafts
    a = (rows_ref - torch.arange(0, case["r"], kmax + 1, device=DEV)).tolist()
    assert a == [int(x) for x in (starts_ref - case["meta"][:, 4 * kmax + 2] - 1)]


@pytest.mark.parametrize("prev", [False, True])
def test_chain_kernel_writes_what_the_reference_writes(prev):
    g = torch.Generator().manual_seed(3)
    greedy = torch.randint(0, 100, (8,), generator=g).double().to(DEV)
    rows = torch.tensor([5, 1, 7], device=DEV)
    out = torch.randn(8, 600, generator=g).to(DEV)
    ids = torch.randint(0, 100, (8,), generator=g).to(DEV)
    results = []
    for kernel in (True, False):
        feats = torch.zeros(8, 600, device=DEV)
        prev_ids = torch.zeros(8, dtype=torch.long, device=DEV) if prev else None
        first = (oi.chain_inputs(greedy, rows, out, feats, ids, prev_ids, use_kernel=True)
                 if kernel else oi.chain_inputs_ref(greedy, rows, out, feats, ids, prev_ids))
        results.append((first, feats, prev_ids))
    (f1, x1, p1), (f2, x2, p2) = results
    assert torch.equal(f1, f2) and f1.tolist() == [greedy[r].item() for r in (5, 1, 7)]
    assert (x1[3:] == 0).all()
    assert torch.equal(x1, x2) and torch.equal(x1[:3], out[rows])
    if prev:
        assert torch.equal(p1, p2) and p1[:3].tolist() == ids[rows].tolist()


@pytest.mark.parametrize("prev", [False, True])
def test_the_warm_up_runs_both_kernels_for_every_k(prev):
    """HeadProposer's warm-up on the GPU (compiling before the first request's rounds): its
    scratch runs work for every k, here through the interpreter."""
    oi.run_every_k(4, 24, prev, torch.float32, torch.device(DEV))
    oi.warm_up(2, 24, prev, torch.float32, torch.device("cpu"))  # the CPU: nothing to compile


def test_catch_up_reference_against_a_hand_computation():
    """Two sequences: k = 3 accepting 1 (bonus 99) and k = 2 accepting both (bonus 77), as in
    test_head_catch_up_inputs_follow_each_rows_acceptance; block size 4."""
    kmax, n = 3, 2
    # verify rows: sequence 0 at 0..3 (drafts 11 12 13: the target says 11, 50, .., bonus at
    # row 1 = 99), sequence 1 at 4..6 (drafts 21 22: both right, bonus 77)
    greedy = torch.tensor([11, 99, 5, 6, 21, 22, 77], dtype=torch.float64)
    drafts = torch.tensor([[11, 21], [12, 22], [13, 0]], dtype=torch.float64).reshape(-1)
    slots0 = [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0]
    slots1 = [5 * 4 + 2, 5 * 4 + 3, 1 * 4 + 0, 1 * 4 + 0]
    meta = torch.tensor([[0, 1, 2, 3] + [0, 2, 4] + [1, 1, 1] + slots0 + [5, 40, 3],
                         [4, 5, 6, 6] + [1, 3, 3] + [1, 1, 0] + slots1 + [2, 41, 2]])
    # the head's tables: each view repeated 4 times
    tables = torch.tensor([[7, 2, 9]] * 4 + [[5, 1, 0]] * 4, dtype=torch.int32)
    feat_src = torch.arange(64, dtype=torch.float32)[:, None].repeat(1, 2)
    inputs = torch.zeros(ROWS, 8, dtype=torch.long)
    lens, prev = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.long)
    feats = torch.zeros(8, 2)
    rows, starts = oi.catch_up_inputs_ref(greedy, drafts, meta, kmax, inputs, lens, tables, 4,
                                          prev, feat_src, feats)
    assert inputs[0].tolist() == [11, 99, 99, 99] + [21, 22, 77, 77]
    assert inputs[1].tolist() == [5, 6, 7, 8] + [2, 3, 4, 5]
    # slots where j <= a: positions 5, 6 in block 2 (table [7, 2, 9]); 2, 3, 4 in 5, 5, 1
    assert inputs[2].tolist() == [2 * 4 + 1, 2 * 4 + 2, -1, -1] + [5 * 4 + 2, 5 * 4 + 3,
                                                                   1 * 4 + 0, -1]
    assert lens.tolist() == [6, 7, 8, 9] + [3, 4, 5, 6]
    assert prev.tolist() == [40, 11, 99, 99, 41, 21, 22, 77]
    assert feats[:, 0].tolist() == [float(x) for x in slots0 + slots1]
    assert rows.tolist() == [1, 4 + 2] and starts.tolist() == [5 + 1 + 1, 2 + 2 + 1]
    assert n * (kmax + 1) == 8


def test_fused_catch_up_drafts_the_rounds_of_the_torch_path(pair, monkeypatch):
    """Batch 1 and 3, long outputs: with the fused catch-up the engine drafts the rounds the
    torch path drafts, outputs stay the target's, and every block comes back; the fused
    path is what overlapped rounds take."""
    from llmaccel.spec.head_proposer import HeadProposer

    d, hf, tensors = pair
    prompts = [[11, 12, 13, 14, 15] * 6 + [3, 4], [5, 6, 7, 8] * 3, list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    calls = []
    orig = HeadProposer.fused_catch_up

    def counted(self, *a, **kw):
        calls.append(1)
        return orig(self, *a, **kw)

    monkeypatch.setattr(HeadProposer, "fused_catch_up", counted)
    got = {}
    for on in (False, True):
        for batch in (1, 3):
            calls.clear()
            llm = _engine(d, True, monkeypatch)
            llm.engine.spec.draft.fused_catch_up_enabled = on  # off: the torch path
            rounds = _record_rounds(llm)
            outs = [o.outputs[0].token_ids for o in
                    llm.generate(prompts[:batch], params, use_tqdm=False)]
            spec = llm.engine.spec
            assert spec.num_overlapped >= 5
            assert len(calls) == (spec.num_overlapped + spec.num_overlap_dropped if on else 0)
            assert llm.engine.block_manager.num_used_blocks == 0
            assert spec.draft.block_manager.num_used_blocks == 0
            got[on, batch] = sorted(rounds), outs
    for batch in (1, 3):
        assert got[True, batch] == got[False, batch]


def test_chain_positions_at_once_equal_placing_them_step_by_step(pair, monkeypatch):
    """CUDAGraphRunner._chain_rows (every chained step's positions, lengths and slots at once)
    gives each step what _place_rows gives it step by step, rows past their count included."""
    d, hf, tensors = pair
    llm = _engine(d, True, monkeypatch)
    graphs = llm.engine.spec.draft.runner.graphs
    bs, steps = 3, 4
    g = torch.Generator().manual_seed(0)
    graphs.block_tables[:bs].copy_(torch.randint(0, 60, graphs.block_tables[:bs].shape,
                                                 generator=g))
    graphs.inputs[6, :bs].copy_(torch.tensor([5, 17, 30]))  # start positions
    graphs.inputs[7, :bs].copy_(torch.tensor([4, 2, 0]))    # steps whose KV is written
    pos, lens, slots = graphs._chain_rows(bs, steps)
    start, count = graphs.inputs[6, :bs], graphs.inputs[7, :bs]
    for s in range(steps):
        graphs._place_rows(bs, start - 1 + count.clamp(max=s + 1), count > s)
        assert torch.equal(pos[s], graphs.inputs[1, :bs])
        assert torch.equal(lens[s], graphs.seq_lens[:bs])
        assert torch.equal(slots[s], graphs.inputs[2, :bs])
