"""Progress bars for work that takes more than a few seconds: one look everywhere (what, a bar,
done/total, elapsed, time remaining), and silent when the output is not a terminal, so logs and
CI output get no redraw noise."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)


def interactive() -> bool:
    """Whether a person watches: stdout or stderr is a terminal."""
    return sys.stdout.isatty() or sys.stderr.isatty()


def progress_bar(*, transient: bool = True, disable: bool = False,
                 console: Console | None = None) -> Progress:
    """A rich Progress with an ETA; disabled where nobody watches."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                    transient=transient, console=console,
                    disable=disable or not (console.is_terminal if console else interactive()))


def quiet_library_progress() -> None:
    """Turn off transformers' and datasets' own tqdm bars where nobody watches (they print a
    line per update into a log file)."""
    if interactive():
        return
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


__all__ = ["interactive", "progress_bar", "quiet_library_progress"]
