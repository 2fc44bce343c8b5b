"""Progress bars: an ETA on every bar a person watches, nothing drawn into logs."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import TimeRemainingColumn

from llmaccel import progress


def test_bars_show_an_eta_on_a_terminal_and_stay_quiet_in_a_log(monkeypatch):
    tty = Console(file=io.StringIO(), force_terminal=True)
    bar = progress.progress_bar(console=tty)
    assert not bar.disable
    assert any(isinstance(c, TimeRemainingColumn) for c in bar.columns)
    log = Console(file=io.StringIO(), force_terminal=False)
    assert progress.progress_bar(console=log).disable
    monkeypatch.setattr(progress, "interactive", lambda: False)
    assert progress.progress_bar().disable


def test_library_bars_are_turned_off_without_a_terminal(monkeypatch):
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(progress, "interactive", lambda: False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    try:
        progress.quiet_library_progress()
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
