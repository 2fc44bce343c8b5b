"""llmaccel/envs.py is the one place environment variables are read: typed, read when asked
for (so a variable set after import counts), a bad value named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmaccel import envs
from llmaccel.errors import LLMAccelError

PACKAGE = Path(__file__).resolve().parents[1] / "llmaccel"


def test_no_module_but_envs_reads_an_llmaccel_variable():
    read = re.compile(r"(environ(\.get)?\(|environ\[|getenv\()\s*[\"']LLMACCEL_")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name != "envs.py" and read.search(p.read_text(encoding="utf-8"))]
    assert not offenders


def test_every_variable_named_in_the_package_is_declared():
    named = set()
    for p in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bLLMACCEL_[A-Z0-9_]+", p.read_text(encoding="utf-8")))
    assert named <= set(envs.environment_variables), named - set(envs.environment_variables)
    assert len(envs.environment_variables) <= 10


def test_defaults_and_values_set_after_import(monkeypatch, tmp_path):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
    assert envs.LLMACCEL_CACHE is None and envs.LLMACCEL_PDL is None
    assert envs.LLMACCEL_CUDA_KERNELS is True and envs.LLMACCEL_DEBUG is False
    monkeypatch.setenv("LLMACCEL_CACHE", str(tmp_path))
    monkeypatch.setenv("LLMACCEL_CUDA_KERNELS", "off")
    monkeypatch.setenv("LLMACCEL_PDL", "1")
    monkeypatch.setenv("LLMACCEL_DEBUG", "0")
    assert envs.LLMACCEL_CACHE == tmp_path
    assert envs.LLMACCEL_CUDA_KERNELS is False and envs.LLMACCEL_PDL is True
    assert envs.LLMACCEL_DEBUG is False


def test_a_bad_boolean_is_named(monkeypatch):
    monkeypatch.setenv("LLMACCEL_NO_SHARED_DATA", "maybe")
    with pytest.raises(LLMAccelError, match="LLMACCEL_NO_SHARED_DATA='maybe'"):
        envs.LLMACCEL_NO_SHARED_DATA
    with pytest.raises(AttributeError):
        envs.LLMACCEL_NOT_A_VARIABLE
