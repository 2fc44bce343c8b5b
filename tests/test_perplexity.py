"""Sliding-window perplexity (llmaccel/eval/perplexity.py): window arithmetic by hand, row
joining, the result on a tiny model against an independent token-by-token computation with
transformers, and the `llmaccel eval ppl` command on the real SmolLM2 GGUF."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmaccel.errors import LLMAccelError
from llmaccel.eval.perplexity import join_rows, perplexity, windows
from llmaccel.models.loader import load_model
from tiny_models import make_tiny_model, tiny_configs


def test_windows_by_hand():
    # stride == context: each window's first token has no history and is not scored
    assert windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    # stride < context: each token scored once, with at least context - stride of history
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert windows(3, 8, 8) == [(0, 3, 1)]
    assert windows(9, 4, 4) == [(0, 4, 1), (4, 8, 5)]  # a last window of one token scores 0
    scored = sum(e - f for _, e, f in windows(1000, 64, 16))
    assert scored == 999  # every token but the very first, exactly once


@pytest.mark.parametrize("args, match", [((10, 1, 1), "context"), ((10, 4, 5), "stride"),
                                         ((10, 4, 0), "stride"), ((1, 4, 4), "at least 2")])
def test_windows_reject_bad_settings(args, match):
    with pytest.raises(LLMAccelError, match=match):
        windows(*args)


def test_hf_row_joining():
    raw = " = Title = \n \n Para one .\n Para two .\n"
    # rows: " = Title = \n", "", " Para one .\n", " Para two .\n", joined with a blank line
    assert join_rows(raw, "hf") == " = Title = \n\n\n\n\n Para one .\n\n\n Para two .\n"
    assert join_rows(raw, "raw") == raw
    with pytest.raises(LLMAccelError, match="joining"):
        join_rows(raw, "csv")


def _independent_ppl(hf, ids, context, stride):
    """Token by token: for each token t scored by window (b, e, f), its NLL from a separate
    transformers forward over ids[b:t] (the last position's log-softmax)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b, e, f in windows(len(ids), context, stride):
            for t in range(f, e):
                logits = hf(torch.tensor([ids[b:t]])).logits[0, -1].double()
                total -= float(torch.log_softmax(logits, -1)[ids[t]])
                count += 1
    return math.exp(total / count), count


@pytest.mark.parametrize("context,stride", [(16, 16), (16, 5)])
def test_perplexity_equals_token_by_token_computation(tmp_path, context, stride):
    hf = make_tiny_model(tiny_configs()["qwen2"], tmp_path)
    _, ours = load_model(str(tmp_path), dtype="float32", device="cpu")
    ids = torch.randint(0, hf.config.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    want, count = _independent_ppl(hf, ids.tolist(), context, stride)
    res = perplexity(ours, ids, context, stride)
    # stride == context leaves each window's first token unscored (45 - 3); overlap does not
    assert res.scored_tokens == count == (42 if stride == context else 44)
    assert res.ppl == pytest.approx(want, rel=1e-5)
    limited = perplexity(ours, ids, context, stride, limit=2)
    assert limited.windows == 2 and limited.scored_tokens < count


def test_eval_ppl_cli_on_smollm2(smollm2_gguf, tmp_path):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    result = CliRunner().invoke(app, ["eval", "ppl", str(smollm2_gguf), "--data", str(text),
                                      "--context", "64", "--limit", "2", "--json",
                                      "--device", "cpu", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.rindex('{"model"'):])
    assert out["windows"] == 2 and out["context"] == 64 and out["joining"] == "file"
    # a repeated sentence is easy: far below a uniform guess over 49,152 tokens
    assert 1.0 < out["ppl"] < 50


def test_eval_ppl_cli_errors_name_the_problem(tmp_path):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    result = CliRunner().invoke(app, ["eval", "ppl", str(tmp_path / "nope"), "--data",
                                      str(tmp_path / "missing.txt")])
    assert isinstance(result.exception, LLMAccelError)
    assert "missing.txt" in str(result.exception)
