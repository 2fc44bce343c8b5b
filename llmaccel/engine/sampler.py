"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, min_tokens, logprobs, with a
generator per sequence so a seeded request samples the same tokens whatever shares its batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token: int
    logprob: float                           # of the chosen token, under the model's softmax
    top_logprobs: dict[int, float] | None    # chosen token + top-k, when logprobs were asked


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float,
                      min_p: float = 0.0) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k, the top-p nucleus and the min-p floor."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values,
                                    float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B]; row i uses params[i] and generators[i]."""
    logits = logits.float()
    out = logits.argmax(-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
        out[i] = torch.multinomial(row.softmax(-1), 1, generator=generators[i])[0]
    return out


def sample_with_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                         generators: list[torch.Generator | None],
                         banned: list[list[int]]) -> list[SampleResult]:
    """Like `sample`, with per-row banned ids (EOS/stop ids before min_tokens) and logprobs of
    the model's own distribution (before temperature and truncation, as vLLM reports them)."""
    raw = logits.float()
    want_top = any(p.logprobs for p in params)
    # The chosen token's logprob is logit - logsumexp: one reduction over the vocabulary,
    # not a full log-softmax tensor, unless someone asked for top-k logprobs.
    logprobs = raw.log_softmax(-1) if want_top else None
    masked = raw
    if any(banned):
        masked = raw.clone()
        for i, ids in enumerate(banned):
            if ids:
                masked[i, ids] = float("-inf")
    tokens_t = sample(masked, params, generators)
    if logprobs is not None:
        chosen_t = logprobs.gather(1, tokens_t[:, None]).squeeze(1)
    else:
        chosen_t = raw.gather(1, tokens_t[:, None]).squeeze(1) - raw.logsumexp(-1)
    # One device-to-host transfer (one sync) for the whole batch: ids are exact in float64.
    tokens_f, chosen = torch.stack([tokens_t.double(), chosen_t.double()]).tolist()
    tokens = [int(t) for t in tokens_f]
    results = []
    for i, (tok, p) in enumerate(zip(tokens, params)):
        top = None
        if p.logprobs is not None:
            top = {tok: chosen[i]}
            if p.logprobs:
                values, ids = logprobs[i].topk(p.logprobs)
                top.update(zip(ids.tolist(), values.tolist()))
        results.append(SampleResult(tok, chosen[i], top))
    return results


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
