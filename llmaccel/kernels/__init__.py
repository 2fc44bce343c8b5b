"""Kernels: tensors in, tensors out. Each has a plain-PyTorch reference that runs on CPU."""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Triton is importable (Linux wheels; CUDA builds of torch bring it)."""
    return importlib.util.find_spec("triton") is not None
