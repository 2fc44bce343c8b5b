"""Running the real `llmaccel` console command in tests, and checking its one-line errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Each run spends ~5 s importing torch + transformers: modules start their runs together.
WORKERS = max(2, min(4, os.cpu_count() or 2))


def llmaccel_exe() -> str:
    exe = Path(sys.executable).with_name("llmaccel")  # the venv running pytest
    if exe.exists():
        return str(exe)
    found = shutil.which("llmaccel")
    if found is None:
        pytest.fail("the `llmaccel` console command is not installed")
    return found


def cli_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="400")  # wide: errors must not wrap
    for key in ("LLMACCEL_DEBUG", "FORCE_COLOR"):
        env.pop(key, None)
    return env


def run_llmaccel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([llmaccel_exe(), *args], capture_output=True, text=True,
                          env=cli_env(), timeout=180)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """Assert the run failed cleanly (non-zero exit, no traceback, one `error:` line on
    stderr) and return that line."""
    assert "Traceback" not in r.stdout, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode != 0, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:"), lines[0]
    return lines[0]
