"""Verify draft tokens against the target model's distributions, losslessly.

One target forward scores the last accepted token plus k drafts, giving k + 1 distributions
per request. Then, per request:

- greedy: accept drafts while each equals the target's argmax; the first mismatch is replaced
  by the argmax (so every step emits at least one token), and when all k match, the argmax
  after the last draft is a bonus token. The output is exactly greedy decoding's.
- sampling (Leviathan et al. 2023, Chen et al. 2023): draft x_i (drawn from q_i) is accepted
  with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the emitted token is
  drawn from normalize(max(0, p_i - q_i)); when all are accepted, a bonus token is drawn from
  p_k. Every emitted token then follows the target distribution exactly. A deterministic
  proposer (n-gram lookup, greedy draft) has q_i = one-hot(x_i): accept with probability
  p_i(x_i), and the residual is p_i with x_i removed.

p and q must come from the same processing (temperature, top-k, top-p, min-p, banned ids):
`processed_probs` is that processing, shared with the draft side, and gives greedy rows a
one-hot p, so one rejection sampler serves a batch that mixes greedy and sampled requests
(with a one-hot p, acceptance is exactly "draft == argmax").

All tensor work stays on the device; `VerifyResult` brings tokens to the host in one transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmaccel.engine.sampler import apply_top_k_top_p
from llmaccel.engine.sampling_params import SamplingParams


@dataclass
class VerifyResult:
    """Per request: the tokens this step emits (accepted drafts, then one corrected or bonus
    token) and how many drafts were accepted; `accepted_mask` [B, k] (drafts accepted, by
    position, False past each request's drafts) feeds the per-position acceptance metrics."""

    tokens: list[list[int]]
    num_accepted: list[int]
    accepted_mask: torch.Tensor


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                    banned: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """logits [B, T, V] -> probabilities [B, T, V] in fp32 after each request's sampling
    processing (as `engine.sampler.sample` applies it: banned ids, temperature, top-k, top-p,
    min-p). Greedy requests get the one-hot of the argmax."""
    logits = logits.float()
    if banned is not None and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, :, list(ids)] = float("-inf")
    probs = torch.empty_like(logits)
    for i, p in enumerate(params):
        if p.greedy:
            probs[i] = torch.nn.functional.one_hot(logits[i].argmax(-1),
                                                   logits.shape[-1]).float()
        else:
            row = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
            probs[i] = row.softmax(-1)
    return probs


def _valid(num_draft: torch.Tensor, k: int) -> torch.Tensor:
    return torch.arange(k, device=num_draft.device)[None, :] < num_draft[:, None]


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B]: how many leading drafts were accepted."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _result(draft_tokens: torch.Tensor, n_acc: torch.Tensor,
            final: torch.Tensor) -> VerifyResult:
    """One transfer to the host: accepted drafts, the final token and the counts."""
    k = draft_tokens.shape[1]
    prefix = torch.arange(k, device=n_acc.device)[None, :] < n_acc[:, None]
    host = torch.cat([draft_tokens, final[:, None], n_acc[:, None]], dim=1).tolist()
    return VerifyResult(tokens=[row[:row[k + 1]] + [row[k]] for row in host],
                        num_accepted=[row[k + 1] for row in host], accepted_mask=prefix)


def greedy_verify_rows(drafts: Sequence[Sequence[int]], argmax: Sequence[float],
                       offsets: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """Greedy verification on the host, from the target's argmax per logits row (row
    offsets[b] + j follows draft j of request b; what a CUDA graph's greedy output already
    holds, so no vocabulary-wide tensor work is left): each request's emitted tokens (the
    accepted prefix plus the argmax after it) and accepted count."""
    tokens, accepted = [], []
    for d, o in zip(drafts, offsets):
        a = 0
        while a < len(d) and d[a] == int(argmax[o + a]):
            a += 1
        tokens.append(list(d[:a]) + [int(argmax[o + a])])
        accepted.append(a)
    return tokens, accepted


def _uniform(shape: tuple[int, ...], device: torch.device,
             generators: Sequence[torch.Generator | None] | None) -> torch.Tensor:
    """U[0, 1) draws, row b from generators[b] when given (a seeded request draws the same
    numbers whatever else is batched)."""
    if generators is None or all(g is None for g in generators):
        return torch.rand(shape, device=device)
    return torch.stack([torch.rand(shape[1:], device=device, generator=g) for g in generators])


def _sample_rows(probs: torch.Tensor,
                 generators: Sequence[torch.Generator | None] | None) -> torch.Tensor:
    if generators is None or all(g is None for g in generators):
        return torch.multinomial(probs, 1).squeeze(1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g)
                      for i, g in enumerate(generators)])


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, num_draft: torch.Tensor,
                     generators: Sequence[torch.Generator | None] | None = None
                     ) -> VerifyResult:
    """Lossless speculative sampling (module docstring).

    draft_tokens [B, k] long; draft_probs [B, k, V] (the proposer's q_i, processed like p) or
    None for a deterministic proposer (q_i = one-hot(x_i)); target_probs [B, k + 1, V] from
    `processed_probs`; num_draft [B] long, each <= k (entries past it are ignored);
    generators: one per request or None."""
    b, k = draft_tokens.shape
    device = target_probs.device
    valid = _valid(num_draft, k)
    tok = draft_tokens.clamp_min(0)[..., None]
    p_tok = target_probs[:, :k].gather(-1, tok).squeeze(-1)
    q_tok = (torch.ones_like(p_tok) if draft_probs is None
             else draft_probs.gather(-1, tok).squeeze(-1))
    u = _uniform((b, k), device, generators)
    # u < p / q without the division (q > 0 for a token the draft drew)
    accept = (u * q_tok < p_tok) & valid
    n_acc = _accepted_prefix(accept)
    rows = torch.arange(b, device=device)
    p_final = target_probs[rows, n_acc]  # [B, V]: p at the first rejection, or the bonus p_k
    rejected = n_acc < num_draft
    at = n_acc.clamp_max(k - 1)
    if draft_probs is None:
        q_final = torch.zeros_like(p_final)
        q_final[rows, draft_tokens[rows, at].clamp_min(0)] = 1.0
    else:
        q_final = draft_probs[rows, at]
    residual = (p_final - q_final).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # A rejection implies p < q somewhere, so the residual has mass; rounding can leave it ~0
    # when p and q agree to fp32 precision, and then p itself is the right distribution.
    residual = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-30), p_final)
    dist = torch.where(rejected[:, None], residual, p_final)
    final = _sample_rows(dist, generators)
    return _result(draft_tokens, n_acc, final)
