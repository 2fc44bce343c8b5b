"""The layer contract (pyproject.toml, [tool.importlinter]): imports point down the layers and
the library never imports through its public root. CI runs `lint-imports` too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_imports_point_down_the_layers():
    beside = Path(sys.executable).parent / "lint-imports"  # the venv running the tests
    exe = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert exe, "import-linter is not installed: pip install -e '.[dev]'"
    res = subprocess.run([exe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout
