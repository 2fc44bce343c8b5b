"""benchmarks/diag_head_copy.py's round-by-round estimate of tokens per round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from diag_head_copy import simulate_rounds  # noqa: E402


def _right(n: int, fn) -> list[list[bool | None]]:
    """right[j][t] = fn(j, t) where draft j + 1 of row t has a token (t + j + 2 < n)."""
    return [[fn(j, t) if t + j + 2 < n else None for t in range(n - 1)] for j in range(4)]


def test_all_right_gives_k_plus_one_and_none_right_gives_one():
    n = 2 + 1 + 50  # the answer after row 1: 50 tokens, 10 rounds of 5
    assert simulate_rounds(_right(n, lambda j, t: True), 1, n) == pytest.approx(5.0)
    assert simulate_rounds(_right(n, lambda j, t: False), 1, n) == pytest.approx(1.0)


def test_rounds_start_where_the_last_one_stopped():
    """Every draft is right at rows 2, 7, 12, ... and wrong elsewhere: rounds from row 2 accept
    all four and land 5 rows on, so every round yields 5, though counted over every
    position 4 rows in 5 would yield 1."""
    n = 4 + 40  # 40 answer tokens after row 2's context x_0..x_3
    right = _right(n, lambda j, t: t % 5 == 2)
    assert simulate_rounds(right, 2, n) == pytest.approx(5.0)
    # from row 3: four rounds of 1 token (rows 3-6), then rounds of 5 from row 7 on
    got = simulate_rounds(right, 3, n)
    assert got == pytest.approx((4 + 35) / (4 + 7), abs=1e-3)  # rounded to 3 places
