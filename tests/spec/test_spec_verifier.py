"""The speculative verifier (spec/verifier.py): sampled tokens follow the target distribution
exactly (chi-square on a tiny vocabulary, drafts close to and far from the target, from a draft
distribution and from a deterministic proposer), greedy verification equals greedy decoding,
and seeded requests are reproducible."""

from __future__ import annotations

import pytest
import torch

from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.spec.verifier import greedy_verify_rows, processed_probs, rejection_sample

V, K, N = 6, 3, 120_000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of `counts` against `probs` (cells with p > 0;
    a count in a p = 0 cell is an outright failure)."""
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         stat.double() / 2))


def _dists(seed: int, far: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p [K + 1, V] and draft q [K, V]: q near p, or concentrated where p is small."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, V, generator=g) ** 2
    p[:, -1] = 0.0  # a token the target never emits
    p /= p.sum(-1, keepdim=True)
    if far:
        q = torch.softmax(-6 * p[:K] + torch.rand(K, V, generator=g), -1)
    else:
        q = (p[:K] + 0.05 * torch.rand(K, V, generator=g))
        q /= q.sum(-1, keepdim=True)
    return p, q


def _emitted_by_position(result, position: int) -> torch.Tensor:
    return torch.tensor([t[position] for t in result.tokens if len(t) > position])


@pytest.mark.parametrize("far", [False, True])
def test_sampled_tokens_follow_the_target_distribution(far):
    p, q = _dists(1 + far, far)
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(11)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g)
                          for i in range(K)], dim=1)  # [N, K], x_i ~ q_i
    result = rejection_sample(drafts, q.expand(N, K, V), p.expand(N, K + 1, V),
                              torch.full((N,), K))
    for pos in range(K + 1):
        got = _emitted_by_position(result, pos)
        assert got.numel() > 2000
        counts = torch.bincount(got, minlength=V).double()
        assert chi_square_p(counts, p[pos].double()) > 1e-4, (pos, counts, p[pos])
    # the test has power: the drafts themselves do not pass as target samples
    draft_counts = torch.bincount(drafts[:, 0], minlength=V).double()
    assert chi_square_p(draft_counts, p[0].double()) < 1e-6
    mean = sum(result.num_accepted) / N
    assert (mean < 1.0) if far else (mean > 1.5)  # close drafts are mostly accepted


def test_deterministic_drafts_keep_the_target_distribution():
    """n-gram style drafts (q = one-hot): accepted with probability p(x), else a token from p
    without x; a draft the target never emits is always rejected."""
    p, _ = _dists(3, False)
    drafts = torch.tensor([[2, 0, V - 1]]).expand(N, K)
    torch.manual_seed(5)
    result = rejection_sample(drafts, None, p.expand(N, K + 1, V), torch.full((N,), K))
    for pos in range(K):
        counts = torch.bincount(_emitted_by_position(result, pos), minlength=V).double()
        assert chi_square_p(counts, p[pos].double()) > 1e-4, (pos, counts)
    assert max(result.num_accepted) <= 2  # position 2's draft has p = 0
    acc0 = sum(n >= 1 for n in result.num_accepted) / N
    assert abs(acc0 - float(p[0, 2])) < 0.01


def test_fewer_drafts_than_k_and_no_drafts():
    """Rows with num_draft < k ignore the padding; a row with none emits one token from p_0."""
    p, _q = _dists(4, False)
    drafts = torch.tensor([[1, 2, 3], [4, -1, -1], [-1, -1, -1]])
    num = torch.tensor([3, 1, 0])
    onehot = torch.nn.functional.one_hot(torch.tensor([1, 2, 3, 4]), V).float()
    # a target that agrees with every draft: all drafts accepted, then the bonus from p[num]
    target = torch.stack([torch.cat([onehot[:3], p[3:]]),
                          torch.cat([onehot[3:4], p[1:]]), p])
    res = rejection_sample(drafts, None, target, num)
    assert res.num_accepted == [3, 1, 0]
    assert res.tokens[0][:3] == [1, 2, 3] and len(res.tokens[0]) == 4
    assert res.tokens[1][0] == 4 and len(res.tokens[1]) == 2
    assert len(res.tokens[2]) == 1
    assert res.accepted_mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]


def test_greedy_verify_equals_greedy_decoding():
    g = torch.Generator().manual_seed(0)
    b, vocab = 64, 50
    logits = torch.randn(b, K + 1, vocab, generator=g)
    argmax = logits.argmax(-1)
    # drafts right up to a random point, then wrong
    cut = torch.randint(0, K + 1, (b,), generator=g)
    drafts = argmax[:, :K].clone()
    wrong = torch.arange(K)[None, :] >= cut[:, None]
    drafts[wrong] = (drafts[wrong] + 1) % vocab
    num = torch.randint(0, K + 1, (b,), generator=g)
    # the target's argmax rows flat, as a step lays them out: num[i] + 1 rows per request
    lists = [drafts[i, :int(num[i])].tolist() for i in range(b)]
    offsets, flat = [], []
    for i, d in enumerate(lists):
        offsets.append(len(flat))
        flat += [float(t) for t in argmax[i, :len(d) + 1]]
    tokens, accepted = greedy_verify_rows(lists, flat, offsets)
    for i in range(b):
        n = min(int(cut[i]), int(num[i]))
        assert accepted[i] == n
        assert tokens[i] == argmax[i, :n + 1].tolist()
    # the rejection sampler with greedy (one-hot) targets is the same rule
    probs = processed_probs(logits, [SamplingParams(temperature=0)] * b)
    same = rejection_sample(drafts, None, probs, num)
    assert same.tokens == tokens and same.num_accepted == accepted


def test_processed_probs_match_the_sampler_processing():
    """Temperature, top-k and top-p as `engine.sampler` applies them; banned ids get zero."""
    logits = torch.tensor([[[2.0, 1.0, 0.5, -1.0, 0.0]]])
    params = SamplingParams(temperature=0.5, top_k=3)
    probs = processed_probs(logits, [params])[0, 0]
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.5]) / 0.5, -1)
    torch.testing.assert_close(probs[:3], want)
    assert probs[3:].sum() == 0
    banned = processed_probs(logits, [SamplingParams(temperature=1.0)], banned=[[0]])[0, 0]
    assert banned[0] == 0 and abs(float(banned.sum()) - 1) < 1e-6


def test_seeded_rows_are_reproducible_whatever_the_batch():
    p, q = _dists(6, True)
    drafts = torch.tensor([[0, 1, 2]] * 3)

    def run(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return rejection_sample(drafts[:len(seeds)], q.expand(len(seeds), K, V),
                                p.expand(len(seeds), K + 1, V),
                                torch.full((len(seeds),), K), gens).tokens

    alone = run([42])[0]
    assert run([7, 42, 9])[1] == alone
    assert run([42])[0] == alone
