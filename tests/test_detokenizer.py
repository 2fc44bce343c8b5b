"""Incremental detokenization equals decoding the whole output, token by token."""

import pytest

from llmaccel.engine.detokenizer import DetokenizerState, detokenize_incrementally
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
