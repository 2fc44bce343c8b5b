"""Kernels: tensors in, tensors out. Each has a plain-PyTorch reference that runs on CPU."""

from __future__ import annotations

import importlib.util

import torch


def triton_available() -> bool:
    """Triton is importable (Linux wheels; CUDA builds of torch bring it)."""
    return importlib.util.find_spec("triton") is not None


def triton_supports_fp8(device: torch.device | str) -> bool:
    """Triton's e4m3 type (fp8e4nv, what a float8_e4m3fn tensor becomes) compiles only for
    NVIDIA compute capability >= 8.9 (Ada, Hopper and later); the interpreter (CPU) has it."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)
