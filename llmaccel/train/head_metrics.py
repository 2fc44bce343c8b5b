"""What a draft head's held-out evaluation measures beside KL and top-1: whether it copies.

Rewriting code, quoting and editing are full of copies: the next token is what followed the
same tokens earlier in the context. A prompt lookup (vLLM's n-gram proposer) finds those; a
head can only if its one attention layer reads the context. Session 36 found trained heads
whose attention had collapsed onto one sink row (0.92 of each query's weight, mean over heads)
and which therefore missed trivial copies (benchmarks/diag_head_copy.py). Two measures make
that visible during training rather than after a W5 run:

- copy positions: where an n-gram lookup in the block proposes the target's next token. The
  head's top-1 there (`heldout_top1_copy`) against elsewhere (`heldout_top1_nocopy`).
- attention shares at draft step 1 (mean over heads, queries past the first MIN_ROW rows):
  `heldout_attn_sink`, the largest mean weight any single key row gets from all the block's
  queries (a collapsed layer puts most weight on one fixed row: near 1; a layer that looks
  up its context moves its weight with the query: small), and `heldout_attn_self`, the mean
  weight of a query on its own row.
"""

from __future__ import annotations

import torch

# the lookup's match length: vLLM's prompt_lookup_min and the engine's default
LOOKUP_MIN = 2
# queries this early have little context to spread over: left out of the attention shares
MIN_ROW = 32


def lookup_proposals(ids: list[int], n: int = LOOKUP_MIN) -> list[int]:
    """Per position t, the token an n-gram lookup proposes for position t + 1: what followed
    the most recent earlier occurrence of ids[t-n+1..t]; -1 where there is none."""
    last: dict[tuple[int, ...], int] = {}  # n-gram -> the position its latest occurrence ends
    out = [-1] * len(ids)
    for t in range(n - 1, len(ids)):
        key = tuple(ids[t - n + 1:t + 1])
        end = last.get(key)
        if end is not None:
            out[t] = ids[end + 1]
        last[key] = t
    return out


def copy_positions(blocks: torch.Tensor, want: torch.Tensor, n: int = LOOKUP_MIN
                   ) -> torch.Tensor:
    """[B, R] bool: where the lookup over each block's tokens proposes `want` [B, R], the
    target's next token after position t + 1 at row t (the head's step-1 row t reads tokens
    0..t+1 and drafts the token at t + 2)."""
    rows = want.shape[1]
    props = torch.tensor([lookup_proposals(b, n)[1:rows + 1] for b in blocks.tolist()],
                         dtype=torch.long)
    return props.to(want.device) == want


@torch.no_grad()
def attention_weights(head, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """[B, R, R]: the head's attention weights at draft step 1 (mean over its heads), row q
    over rows 0..q, for blocks `ids` [B, R + 1] and their features [B, R, H]: its layer's q
    and k of fc's output rows, rotated as the layer rotates them (checked against
    transformers' eager attention in tests/test_head_prev_token.py)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, n = ids.shape[0], ids.shape[1] - 1
    prev = ids[:, :-1] if head.prev_token else None
    h = head._inputs(ids[:, 1:], head.fuse_features(features), prev).float()
    attn = head.layers[0].self_attn
    d = attn.head_dim
    q = attn.q_proj(h).view(b, n, -1, d).transpose(1, 2)
    k = attn.k_proj(h).view(b, n, -1, d).transpose(1, 2)
    cos, sin = head.rotary_emb(h, torch.arange(n, device=h.device)[None].expand(b, n))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    later = torch.ones(n, n, dtype=torch.bool, device=h.device).triu(1)
    return scores.masked_fill(later, float("-inf")).softmax(-1).mean(1)


def attention_shares(weights: torch.Tensor, min_row: int = MIN_ROW) -> dict[str, float]:
    """heldout_attn_sink and heldout_attn_self of weights [B, R, R] (the module docstring),
    over queries min_row.. (all of them when the blocks are shorter)."""
    rows = weights.shape[1]
    start = min_row if rows > min_row else 0
    w = weights[:, start:]
    column = w.mean(1)  # [B, R]: each key row's mean weight over the queries
    own = torch.diagonal(weights, dim1=1, dim2=2)[:, start:]
    return {"heldout_attn_sink": float(column.max(-1).values.mean()),
            "heldout_attn_self": float(own.mean())}
