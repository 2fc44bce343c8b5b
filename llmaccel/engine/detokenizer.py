"""Incremental detokenization: O(1) work per new token instead of decoding the whole output.

Decoding a token alone loses context (a SentencePiece word-start marker, a byte split across
tokens), so each step decodes a short window twice, with and without the new tokens, from the
same starting token, and keeps the difference. While the newest tokens end in an incomplete
UTF-8 character (decoded as U+FFFD) nothing is emitted; the window grows until it completes.
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
