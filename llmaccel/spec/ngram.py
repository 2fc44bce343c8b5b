"""N-gram prompt lookup (vLLM's `method="ngram"`, "prompt lookup decoding"): draft the tokens
that followed the latest earlier occurrence of the context's last n tokens.

Code edits, summaries and RAG answers copy long spans of their input; when the last n tokens
appeared before, what followed them then is a free guess at what follows now. Longer suffixes
are tried first (prompt_lookup_max down to prompt_lookup_min): a longer match is more often
right. No model runs, so a wrong guess costs only the extra positions in the verify step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(tokens: np.ndarray | list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for a context `tokens` (prompt + output so far): the tokens after
    the latest earlier match of its longest suffix (max_n down to min_n tokens) that has one;
    [] when no suffix recurs. Never proposes past the context's end."""
    ctx = np.asarray(tokens, dtype=np.int64)
    length = ctx.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = ctx[length - n:]
        # windows starting at 0 .. length - n - 1: every earlier position, not the suffix itself
        windows = sliding_window_view(ctx[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest match: the most recent context wins
            return ctx[start:start + k].tolist()
    return []


class NgramProposer:
    """Drafts for a batch of requests from their own contexts (`SpeculativeConfig` names)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, contexts: list[list[int]], ks: list[int] | None = None
                ) -> list[list[int]]:
        """One draft list per context, each at most ks[i] (default k) long; deterministic, so
        the verifier treats them as q = one-hot."""
        ks = ks if ks is not None else [self.k] * len(contexts)
        return [ngram_propose(ctx, k, self.min_n, self.max_n) if k > 0 else []
                for ctx, k in zip(contexts, ks)]
