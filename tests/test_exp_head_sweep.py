"""benchmarks/exp_head_sweep.py's variant settings and its tokens-per-round estimate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from exp_head_sweep import parse_variant, tokens_per_round  # noqa: E402


def test_variants_parse_into_distill_settings():
    assert parse_variant("lr=1e-4,attention_init=random,copy_attention_heads=6,"
                         "prev_token=true") == {"lr": 1e-4, "attention_init": "random",
                                                "copy_attention_heads": 6, "prev_token": True}
    assert parse_variant("") == {}
    with pytest.raises(SystemExit, match="bad variant setting"):
        parse_variant("learning_rate=1e-4")  # not a DistillConfig field
    with pytest.raises(SystemExit, match="bad variant setting"):
        parse_variant("lr")


def test_tokens_per_round_is_the_chain_of_step_agreements():
    score = {"heldout_top1": 0.5, "heldout_top1_step2": 0.5, "heldout_top1_step3": 0.5,
             "heldout_top1_step4": 0.5}
    assert tokens_per_round(score) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert tokens_per_round({"heldout_top1": 0.8}) == pytest.approx(1.8)  # later steps missing
