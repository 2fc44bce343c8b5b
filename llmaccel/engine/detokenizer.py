"""Incremental detokenization: O(1) work per new token instead of decoding the whole output.

Decoding a token alone loses context (a SentencePiece word-start marker, a byte split across
tokens), so each step decodes a short window twice, with and without the new tokens, from the
same starting token, and keeps the difference. While the newest tokens end in an incomplete
UTF-8 character (decoded as U+FFFD) nothing is emitted; the window grows until it completes.

`detokenize_rest` catches up many tokens at once (a sequence whose text nobody reads until it
finishes): one decode of the window, backing off a trailing incomplete character as the
token-by-token walk would have held it back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokenizerState:
    prefix_offset: int = 0  # window start
    read_offset: int = 0    # tokens up to here are already in the text


def detokenize_incrementally(tokenizer, token_ids: list[int], state: DetokenizerState,
                             skip_special_tokens: bool = True) -> str:
    """New text produced by the tokens after state.read_offset; advances `state`."""
    window = token_ids[state.prefix_offset:]
    before = tokenizer.decode(token_ids[state.prefix_offset:state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    after = tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
    if len(after) > len(before) and not after.endswith("\ufffd"):
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
        return after[len(before):]
    return ""


# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens: an output that still
# ends in U+FFFD after backing off this many tokens ends in a real U+FFFD (or is pathological)
# and is not searched further.
_MAX_BACKOFF = 8


def detokenize_rest(tokenizer, token_ids: list[int], state: DetokenizerState,
                    skip_special_tokens: bool = True) -> str:
    """All the new text of the tokens after state.read_offset, in one decode: what calling
    `detokenize_incrementally` after each of them would have emitted in total. Where the last
    tokens end in an incomplete character, the text stops before them (as the token-by-token
    walk stops at its last complete point); advances `state` to where the text ends."""
    n = len(token_ids)
    if n <= state.read_offset:
        return ""
    before = tokenizer.decode(token_ids[state.prefix_offset:state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    for end in range(n, max(state.read_offset, n - _MAX_BACKOFF), -1):
        after = tokenizer.decode(token_ids[state.prefix_offset:end],
                                 skip_special_tokens=skip_special_tokens)
        if after.endswith("\ufffd"):
            continue
        if len(after) > len(before):
            state.prefix_offset, state.read_offset = state.read_offset, end
            return after[len(before):]
        return ""
    return ""
