"""Incremental detokenization equals decoding the whole output, token by token."""

import pytest

from llmaccel.engine.detokenizer import (DetokenizerState, detokenize_incrementally,
                                         detokenize_rest)
from llmaccel.models.config import make_model_config
from llmaccel.models.tokenizer import get_tokenizer

TEXTS = ["Hello world, this is a test.", "  leading spaces and\nnewlines\n\n",
         "Unicode: héllo wörld — ünïcödé 日本語 🚀🚀 done", "def f(x):\n    return x**2  # ok"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return get_tokenizer(make_model_config(str(smollm2_gguf)))


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    state, pieces = DetokenizerState(), []
    for i in range(1, len(ids) + 1):
        pieces.append(detokenize_incrementally(tokenizer, ids[:i], state))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces)


def _token_by_token(tokenizer, ids):
    state, pieces = DetokenizerState(), []
    for i in range(1, len(ids) + 1):
        pieces.append(detokenize_incrementally(tokenizer, ids[:i], state))
    return "".join(pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_rest_at_once_equals_token_by_token_at_every_cut(tokenizer, text):
    """What a deferred sequence's text is (`detokenize_rest` at its end) equals what the
    token-by-token walk emits, wherever the output stops, inside a multi-byte character too
    (there both hold the incomplete character back); also when part of it was done before."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    for cut in range(1, len(ids) + 1):
        want = _token_by_token(tokenizer, ids[:cut])
        assert detokenize_rest(tokenizer, ids[:cut], DetokenizerState()) == want, cut
        # the first half token by token (a streamed prefix), the rest at once
        state, half = DetokenizerState(), []
        for i in range(1, cut // 2 + 1):
            half.append(detokenize_incrementally(tokenizer, ids[:i], state))
        assert "".join(half) + detokenize_rest(tokenizer, ids[:cut], state) == want, cut


def test_rest_holds_back_only_the_incomplete_character(tokenizer):
    """An output cut inside an emoji keeps the text before it (the walk's last complete
    point), where one decode of the whole window would have given nothing."""
    ids = tokenizer("abc 🚀", add_special_tokens=False).input_ids
    # the emoji's bytes come in more than one token in this vocabulary
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")
    assert detokenize_incrementally(tokenizer, ids[:-1], DetokenizerState()) == ""
    state = DetokenizerState()
    text = detokenize_rest(tokenizer, ids[:-1], state)
    assert text == _token_by_token(tokenizer, ids[:-1])
    assert text.startswith("abc") and "\ufffd" not in text
    # and the rest arrives once the character completes
    assert text + detokenize_rest(tokenizer, ids, state) == "abc 🚀"
