"""N-gram prompt lookup (vLLM's `method="ngram"`, "prompt lookup decoding"): draft the tokens
that followed the latest earlier occurrence of the context's last n tokens.

Code edits, summaries and RAG answers copy long spans of their input; when the last n tokens
appeared before, what followed them then is a free guess at what follows now. Longer suffixes
are tried first (prompt_lookup_max down to prompt_lookup_min): a longer match is more often
right. No model runs, so a wrong guess costs only the extra positions in the verify step.
"""

from __future__ import annotations


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for a context `tokens` (prompt + output so far): the tokens after
    the latest earlier match of its longest suffix (max_n down to min_n tokens) that has one;
    [] when no suffix recurs. Never proposes past the context's end. (A one-off lookup; the
    engine keeps an `NgramIndex` per sequence.)"""
    return NgramIndex(min_n, max_n).propose(_TokenList(list(tokens)), k)


class _TokenList:
    """A plain list as the sequence interface `NgramIndex` reads."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.num_tokens = len(tokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


class NgramIndex:
    """Incremental n-gram lookup for one growing sequence: each n-gram (min_n..max_n tokens)
    maps to the latest position where it ends, so a lookup is a few dict probes instead of a
    pass over the context. Tests check it against the definition (a window of each length
    slid over the context) and an incremental index against a fresh one."""

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
