"""What a draft head's held-out evaluation measures beside KL and top-1: whether it copies.

Rewriting code, quoting and editing are full of copies: the next token is what followed the
same tokens earlier in the context. A prompt lookup (vLLM's n-gram proposer) finds those; a
head can only if its one attention layer reads the context. Trained heads were found
whose attention had collapsed onto one sink row (0.92 of each query's weight, mean over heads)
and which therefore missed trivial copies. Two measures make
that visible during training rather than after a W5 run:

- copy positions: where an n-gram lookup in the block proposes the target's next token. The
  head's top-1 there (`heldout_top1_copy`) against elsewhere (`heldout_top1_nocopy`).
- attention shares at draft step 1 (mean over heads, queries past the first MIN_ROW rows):
  `heldout_attn_sink`, the largest mean weight any single key row gets from all the block's
  queries (a collapsed layer puts most weight on one fixed row: near 1; a layer that looks
  up its context moves its weight with the query: small), and `heldout_attn_self`, the mean
  weight of a query on its own row, and `heldout_attn_copy`, the mean weight a copy position's
  query puts on its lookup source (the row whose previous token is the query's next token and
  whose next token is the copy): an induction lookup done by the layer itself.

`copy_attention_loss` turns the last one into a training signal (DistillConfig.
copy_attention_weight): some of the layer's heads are taught to attend to the lookup source
at copy positions. The collapse was measured within the first 1,000 steps for every
learning rate and q/k init tried:
reading the context never pays off early enough to be found by the main loss alone.
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
    return copy_rows(blocks.to(want.device), want, n)[0]


def lookup_sources(blocks: torch.Tensor, n: int = LOOKUP_MIN) -> torch.Tensor:
    """[B, T] long: per position t, where the most recent earlier occurrence of the n tokens
    ending at t ends (so blocks[:, e + 1] is what `lookup_proposals` proposes); -1 where there
    is none. Vectorized over a batch of blocks (training computes it every step)."""
    b, t = blocks.shape
    if n > 3:  # token ids < 2^20 (every vocabulary we know): 3 of them fit one int64 key
        raise ValueError(f"lookup_sources matches at most 3 tokens, got n={n}")
    key = torch.zeros_like(blocks)
    for i in range(n):  # the n-gram ending at each position as one exact key (no host sync)
        key = key * (1 << 20) + blocks.roll(n - 1 - i, dims=1)
    pos = torch.arange(t, device=blocks.device)
    valid = pos >= n - 1
    same = (key[:, :, None] == key[:, None, :]) & (pos[None, :] < pos[:, None])[None]
    same &= valid[None, :, None] & valid[None, None, :]
    latest = torch.where(same, pos[None, None, :], -1).max(-1).values
    return latest


def copy_rows(blocks: torch.Tensor, want: torch.Tensor | None = None,
              n: int = LOOKUP_MIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(copy [B, R] bool, source [B, R] long) for the head's step-1 rows t = 0..R-1 (row t
    reads tokens 0..t+1 and drafts t + 2): copy where the lookup at t + 1 proposes `want`
    (default: the block's own token at t + 2, rows past the block never copy), source the row
    whose next token the lookup proposes (e, the match's end: row e's next token is
    x_{e+1}), 0 where there is none."""
    rows = blocks.shape[1] - 1 if want is None else want.shape[1]
    end = lookup_sources(blocks, n)[:, 1:rows + 1]
    proposal = blocks.gather(1, (end + 1).clamp(min=0, max=blocks.shape[1] - 1))
    if want is None:
        want = torch.full_like(end, -1)
        want[:, :blocks.shape[1] - 2] = blocks[:, 2:]
    copy = (end >= 0) & (proposal == want)
    return copy, end.clamp(min=0)


def taught_heads(num_heads: int, num_kv_heads: int, n: int, spread: bool) -> list[int]:
    """The query heads the copy loss teaches: the first n, or with `spread` one per key/value
    group in turn (0, group, 2 group, ..., then 1, group + 1, ...), so that the taught heads
    read different keys and values (GQA: the heads of one group share them)."""
    if not 1 <= n <= num_heads:
        raise ValueError(f"cannot teach {n} of {num_heads} attention heads")
    if not spread:
        return list(range(n))
    group = num_heads // num_kv_heads
    order = [kv * group + j for j in range(group) for kv in range(num_kv_heads)]
    return order[:n]


def _taught(head, heads: int, spread: bool) -> list[int]:
    """taught_heads for this head's attention layer."""
    config = head.layers[0].self_attn.config
    return taught_heads(config.num_attention_heads, config.num_key_value_heads, heads, spread)


def _scores(head, ids: torch.Tensor, features: torch.Tensor, heads: list[int] | None = None
            ) -> torch.Tensor:
    """[B, len(heads), R, R] attention scores at draft step 1 of the layer's query heads
    `heads` (all by default), later rows masked to -inf: its q and k of fc's output rows,
    rotated as the layer rotates them."""
    b, n = ids.shape[0], ids.shape[1] - 1
    prev = ids[:, :-1] if head.prev_token else None
    h = head._inputs(ids[:, 1:], head.fuse_features(features), prev)
    rows = torch.arange(n, device=h.device)
    return _scores_of(head, h, rows[None].expand(b, n), rows[None, :] <= rows[:, None], heads)


def _scores_of(head, h: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
               heads: list[int] | None = None) -> torch.Tensor:
    """[B, len(heads), R, R]: the scores of the layer's query heads `heads` over its input
    rows h [B, R, H] at `positions` [B, R], -inf where allowed [R, R] is False."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, n = h.shape[0], h.shape[1]
    h = h.float()
    attn = head.layers[0].self_attn
    d = attn.head_dim
    q = attn.q_proj(h).view(b, n, -1, d).transpose(1, 2)
    k = attn.k_proj(h).view(b, n, -1, d).transpose(1, 2)
    group = q.shape[1] // k.shape[1]  # query heads per key/value head (GQA)
    heads = list(range(q.shape[1])) if heads is None else heads
    q = q[:, heads]
    k = k[:, [i // group for i in heads]]  # each query head's own key/value head
    cos, sin = head.rotary_emb(h, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    return scores.masked_fill(~allowed, float("-inf"))


@torch.no_grad()
def attention_weights(head, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """[B, R, R]: the head's attention weights at draft step 1 (mean over its heads), row q
    over rows 0..q, for blocks `ids` [B, R + 1] and their features [B, R, H] (checked against
    transformers' eager attention in tests/train/test_head_prev_token.py)."""
    return _scores(head, ids, features).softmax(-1).mean(1)


def copy_attention_loss(head, ids: torch.Tensor, features: torch.Tensor, heads: int,
                        spread: bool = False) -> torch.Tensor:
    """Mean over copy positions (copy_rows) and `heads` of the layer's query heads
    (taught_heads: the first ones, or with `spread` one per key/value group in turn) of
    -log(attention weight on the lookup source): teaches those heads the induction lookup.
    0 where a batch has no copy position."""
    copy, source = copy_rows(ids)
    chosen = _taught(head, heads, spread)
    return _source_nll(_scores(head, ids, features, chosen), copy, source)


def _source_nll(scores: torch.Tensor, copy: torch.Tensor, source: torch.Tensor
                ) -> torch.Tensor:
    """Mean of -log softmax(scores)[source] over the copy rows and the heads of scores
    [B, heads, R, R]; copy and source [B, R]."""
    logw = scores.log_softmax(-1)
    picked = logw.gather(-1, source[:, None, :, None].expand(-1, logw.shape[1], -1, 1))[..., 0]
    mask = copy[:, None, :].expand_as(picked).to(picked.dtype)
    # a source row is never later than its query (no -inf picked); no host sync here
    return -(picked * mask).sum() / mask.sum().clamp(min=1.0)


def unrolled_copy_rows(blocks: torch.Tensor, steps: int, n: int = LOOKUP_MIN
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """copy_rows for every row of DraftHead.unroll_with_inputs' last layer call: (copy, source)
    [B, steps (T - 1)], row a (T - 1) + t being step a + 1's row t. That row drafts
    x_{t+a+2} after the context x_0..x_{t+1} and the drafts x_{t+2}..x_{t+a+1} (taken as
    right, as training feeds them): the lookup at position t + a + 1 over the block. Its
    source is the row whose next token is what the lookup proposes, the row at the match's
    end e: the context's row e where e <= t, else the same row t's step e - t block (the
    layer's mask lets row t see exactly those)."""
    b, length = blocks.shape
    rows = length - 1
    end = lookup_sources(blocks, n)  # [B, T]
    t = torch.arange(rows, device=blocks.device)
    copies, sources = [], []
    for a in range(steps):
        pos = t + a + 1  # the lookup's position; its token x_{pos+1} is the draft
        inside = pos + 1 < length
        e = end[:, pos.clamp(max=length - 1)]
        proposal = blocks.gather(1, (e + 1).clamp(min=0, max=length - 1))
        want = blocks[:, (pos + 1).clamp(max=length - 1)]
        copy = (e >= 0) & (proposal == want) & inside
        e = e.clamp(min=0)
        # 0 where there is no copy: a clamped position's match may lie past this row's blocks
        sources.append(torch.where(copy, torch.where(e <= t, e, (e - t) * rows + t), 0))
        copies.append(copy)
    return torch.cat(copies, dim=1), torch.cat(sources, dim=1)


def unrolled_copy_attention_loss(head, ids: torch.Tensor, h: torch.Tensor,
                                 positions: torch.Tensor, allowed: torch.Tensor, heads: int,
                                 spread: bool = False, decay: float = 1.0) -> torch.Tensor:
    """copy_attention_loss at every draft step of an unrolled pass (its last layer call's
    rows h, positions and mask: DraftHead.unroll_with_inputs), so the taught heads also find
    the source when the query row is the head's own output (steps 2..), not only the
    target's feature. Each step's mean, weighted by decay ** (step - 1) as head_losses
    weights the steps. Step 1's part equals copy_attention_loss (its rows see only step 1's)."""
    rows = ids.shape[1] - 1
    steps = h.shape[1] // rows
    copy, source = unrolled_copy_rows(ids, steps)
    chosen = _taught(head, heads, spread)
    scores = _scores_of(head, h, positions, allowed, chosen)
    total, weights = 0.0, 0.0
    for a in range(steps):
        part = slice(a * rows, (a + 1) * rows)
        weight = decay ** a
        total = total + weight * _source_nll(scores[:, :, part], copy[:, part], source[:, part])
        weights += weight
    return total / weights


def attention_shares(weights: torch.Tensor, min_row: int = MIN_ROW,
                     blocks: torch.Tensor | None = None) -> dict[str, float]:
    """heldout_attn_sink and heldout_attn_self of weights [B, R, R] (the module docstring),
    over queries min_row.. (all of them when the blocks are shorter); with the `blocks`
    [B, R + 1] they were computed on, heldout_attn_copy too (where there is a copy)."""
    rows = weights.shape[1]
    start = min_row if rows > min_row else 0
    w = weights[:, start:]
    column = w.mean(1)  # [B, R]: each key row's mean weight over the queries
    own = torch.diagonal(weights, dim1=1, dim2=2)[:, start:]
    out = {"heldout_attn_sink": float(column.max(-1).values.mean()),
           "heldout_attn_self": float(own.mean())}
    if blocks is not None:
        copy, source = copy_rows(blocks.to(weights.device))
        if copy.any():
            on_source = weights.gather(-1, source[..., None])[..., 0]
            out["heldout_attn_copy"] = float(on_source[copy].mean())
    return out
