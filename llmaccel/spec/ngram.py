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

    def update(self, seq) -> None:
        """Index the n-grams ending at `indexed` .. length - 2: every position but the last,
        never the suffix itself, so the latest entry of a suffix is its latest earlier match.
        The engine also calls this while the GPU runs a step (SpecDecoder.index_running), so
        a sequence that had no drafts for a while (speculation off at its batch size, a new
        prompt) does not catch up on every token at once in the next speculative round."""
        length = seq.num_tokens
        first = self.indexed  # the first end position to index
        if first >= length - 1:
            return
        lo = max(0, first - self.max_n + 1)
        toks = seq.token_slice(lo, length - 1)
        last = self.last_end
        if length - 1 - first <= 4:
            # A few new tokens (a speculative round's): one slice per end and n costs less
            # than setting up the zips below (~3x less at 2 tokens on a CPU).
            for end in range(first - lo, length - 1 - lo):
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    last[tuple(toks[end - n + 1:end + 1])] = end + lo
            self.indexed = length - 1
            return
        # One dict.update per n over zipped windows (C loops, ~2x a loop per token and n:
        # catching up on 100 tokens each took ~10 ms at batch 64 on an H100 host with that
        # loop, a gap before the verify step in a step trace). Later windows overwrite earlier ones: the latest end
        # wins, as a lookup needs.
        for n in range(self.min_n, self.max_n + 1):
            start = max(first - n + 1, 0)  # the first window of n tokens ending >= first
            if start + n > length - 1:
                continue  # no window of n tokens ends before the last token
            # zip of n shifted slices: the n-token windows (1-tuples for n = 1)
            windows = zip(*(toks[start - lo + j:] for j in range(n)))
            last.update(zip(windows, range(start + n - 1, length - 1)))
        self.indexed = length - 1

    def propose(self, seq, k: int) -> list[int]:
        """Up to k drafts for `seq` (an engine Sequence: token_slice, num_tokens)."""
        length = seq.num_tokens
        if k <= 0 or length < 2:
            return []
        self.update(seq)
        return self._lookup(seq, length, k)

    def _lookup(self, seq, length: int, k: int) -> list[int]:
        """Drafts for the context of seq's first `length` tokens; the index must hold exactly
        the n-grams that end before its last token (`indexed == length - 1`)."""
        last = self.last_end
        suffix = seq.token_slice(max(0, length - self.max_n), length)
        tail = len(suffix)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = last.get(tuple(suffix[tail - n:]))
            if end is not None:
                return seq.token_slice(end + 1, min(end + 1 + k, length))
        return []

    def shadow(self, seq, k: int) -> tuple[int, int] | None:
        """What lookup would have done at the first position not indexed yet, had the
        sequence speculated there: (drafts, accepted), the drafts checked against the tokens
        decoded since (exactly a greedy verify's answer: the drafts depend on the tokens
        alone); then the index catches up. None, index unchanged, while fewer than k known
        tokens (all but the last: it may be a placeholder) follow that position. A new index
        first catches up on the prompt."""
        length = self.indexed + 1  # the context whose own suffix is not indexed yet
        if length < 2:
            self.update(seq)
            return None
        if seq.num_tokens - 1 < length + k:
            return None
        drafts = self._lookup(seq, length, k)
        accepted = 0
        for d, t in zip(drafts, seq.token_slice(length, length + len(drafts))):
            if d != t:
                break
            accepted += 1
        self.update(seq)
        return len(drafts), accepted
