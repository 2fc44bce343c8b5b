"""NVRTC for the CPU tests that compile the CUDA C kernels (no GPU needed): the library from a
CUDA toolkit or the nvidia-cuda-nvrtc wheel, patched into `cuda_rtc` for the test, or a skip."""

from __future__ import annotations

import ctypes
import glob

import pytest

from llmaccel.kernels import cuda_rtc


def _nvrtc() -> ctypes.CDLL | None:
    paths = sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"))
    try:
        import nvidia  # the nvidia-cuda-nvrtc wheel, where installed

        for root in nvidia.__path__:
            paths += sorted(glob.glob(f"{root}/*/lib/libnvrtc.so*"))
    except ImportError:
        pass
    for p in [p for p in paths if "builtins" not in p]:
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    return None


def use_nvrtc(monkeypatch) -> None:
    """Make `cuda_rtc` compile with this machine's NVRTC (libcuda is never touched by
    compiling), or skip the test where none is installed."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("no NVRTC library installed (pip install nvidia-cuda-nvrtc)")
    monkeypatch.setattr(cuda_rtc, "_libs", lambda: (lib, None))
