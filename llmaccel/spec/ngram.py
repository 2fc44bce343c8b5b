"""N-gram prompt lookup (vLLM's `method="ngram"`, "prompt lookup decoding"): draft the tokens
that followed the latest earlier occurrence of the context's last n tokens.

Code edits, summaries and RAG answers copy long spans of their input; when the last n tokens
appeared before, what followed them then is a free guess at what follows now. Longer suffixes
are tried first (prompt_lookup_max down to prompt_lookup_min): a longer match is more often
right. No model runs, so a wrong guess costs only the extra positions in the verify step.
"""

from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray | list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for a context `tokens` (prompt + output so far): the tokens after
    the latest earlier match of its longest suffix (max_n down to min_n tokens) that has one;
    [] when no suffix recurs. Never proposes past the context's end.

    One pass over the context: every earlier occurrence of the last token is a candidate end
    of a match, and its match length is counted backwards over at most max_n tokens (a few
    vectorized comparisons), instead of sliding a window of each length over the context."""
    ctx = np.asarray(tokens, dtype=np.int64)
    length = ctx.shape[0]
    if length < 2 or max_n < 1:
        return []
    ends = np.flatnonzero(ctx[:length - 1] == ctx[length - 1])  # candidate match ends
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched so far (the last)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        pos = ends - j
        ok = alive & (pos >= 0)
        ok[ok] = ctx[pos[ok]] == ctx[length - 1 - j]
        alive = ok
        matched += alive
    best = min(max_n, int(matched.max()))
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched >= best)[-1]])  # the latest of the longest
    return ctx[end + 1:end + 1 + k].tolist()


class NgramIndex:
    """Incremental n-gram lookup for one growing sequence: each n-gram (min_n..max_n tokens)
    maps to the latest position where it ends, so a lookup is a few dict probes instead of a
    pass over the context (at batch 64 the array search cost ~2 ms of host time per step).
    Same answers as `ngram_propose` (tests compare them)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in last_end

    def propose(self, seq, k: int) -> list[int]:
        """Up to k drafts for `seq` (an engine Sequence: token_slice, num_tokens)."""
        length = seq.num_tokens
        if k <= 0 or length < 2:
            return []
        # Index the n-grams ending at indexed .. length - 2: every earlier position, never the
        # suffix itself, so the latest entry is the latest earlier match.
        lo = max(0, self.indexed - self.max_n + 1)
        toks = seq.token_slice(lo, length)
        last = self.last_end
        for end in range(self.indexed, length - 1):
            i = end - lo
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                last[tuple(toks[i - n + 1:i + 1])] = end
        self.indexed = max(self.indexed, length - 1)
        tail = len(toks)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = last.get(tuple(toks[tail - n:]))
            if end is not None:
                return seq.token_slice(end + 1, min(end + 1 + k, length))
        return []


class NgramProposer:
    """Drafts for a batch of requests from their own contexts (`SpeculativeConfig` names)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, contexts: list[list[int] | np.ndarray], ks: list[int] | None = None
                ) -> list[list[int]]:
        """One draft list per context, each at most ks[i] (default k) long; deterministic, so
        the verifier treats them as q = one-hot."""
        ks = ks if ks is not None else [self.k] * len(contexts)
        return [ngram_propose(ctx, k, self.min_n, self.max_n) if k > 0 else []
                for ctx, k in zip(contexts, ks)]
