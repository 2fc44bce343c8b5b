"""Every tool in benchmarks/ answers --help (a CPU smoke test of its imports and arguments);
the module that other tools import (step_trace) imports."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TOOLS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "step_trace.py")


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_answers_help(tool, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [tool, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(BENCH / tool), run_name="__main__")
    assert exit_.value.code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


def test_step_trace_imports(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    module = runpy.run_path(str(BENCH / "step_trace.py"))
    assert isinstance(module["StepTrace"], type) and callable(module["brief"])
