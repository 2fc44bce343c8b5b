"""Helpers shared by the checkpoint formats."""

from __future__ import annotations

import torch

from llmaccel.errors import QuantizationError


def as_codes(values: torch.Tensor, name: str, num_bits: int) -> torch.Tensor:
    """Integer-valued tensor in [0, 2^bits - 1] as int64; floats are accepted when integral."""
    if values.is_floating_point():
        if not torch.equal(values, values.round()):
            raise QuantizationError(f"{name} must hold integers, got non-integral floats")
    elif values.dtype == torch.bool or values.is_complex():
        raise QuantizationError(f"{name} must be an integer tensor, got {values.dtype}")
    as_int = values.detach().to(torch.int64)
    top = (1 << num_bits) - 1
    if as_int.numel() and (as_int.min() < 0 or as_int.max() > top):
        raise QuantizationError(
            f"{name} must lie in [0, {top}] for {num_bits}-bit codes, "
            f"got [{int(as_int.min())}, {int(as_int.max())}]"
        )
    return as_int
