"""Round-to-nearest (RTN) weight quantization: int8 per channel, int4 per group, sym or asym.

The conventions here are shared by every algorithm in `llmaccel.quant` and by GPTQ/AWQ
checkpoints. A Linear weight W [out_features, in_features] is cut along in_features into groups
of `group_size` consecutive input channels (-1: one group per output row). Codes are unsigned,
0 .. 2**bits - 1, and each (row, group) has a scale and an integer zero point:

    W_hat[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g],    g = i // group_size

Symmetric schemes fix the zero point at 2**(bits - 1) (8 for int4, 128 for int8): that is what
vLLM's Marlin kernels assume for sym GPTQ (scalar types uint4b8 / uint8b128), so sym checkpoints
run there without reading qzeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.errors import QuantizationError
from llmaccel.models.layers.packed_formats import (  # noqa: F401 - read side, shared
    SUPPORTED_BITS,
)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized Linear weight in the unpacked reference layout (one code per element)."""

    codes: torch.Tensor  # uint8 [out_features, in_features], values 0 .. 2**bits - 1
    scales: torch.Tensor  # [out_features, n_groups], in the dtype the checkpoint will store
    zeros: torch.Tensor  # int32 [out_features, n_groups], values 0 .. 2**bits - 1
    bits: int
    group_size: int  # -1: one group spanning all of in_features
    sym: bool

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def group_len(self) -> int:
        """Input channels per group, with -1 resolved to in_features."""
        return self.in_features if self.group_size == -1 else self.group_size


def check_group_size(in_features: int, group_size: int) -> int:
    """The number of input channels per group; ValueError if `group_size` cannot tile the row."""
    if group_size == -1:
        return in_features
    if group_size <= 0:
        raise QuantizationError(f"group_size must be a positive integer or -1 (per channel), "
                                f"got {group_size}")
    if in_features % group_size != 0:
        fits = [g for g in (32, 64, 128) if in_features % g == 0]
        hint = f"; sizes that fit: {fits} or -1" if fits else "; use -1 (one group per channel)"
        raise QuantizationError(f"group_size={group_size} does not divide in_features={in_features}"
                                f"{hint}")
    return group_size


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise QuantizationError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def _sym_divisor(bits: int) -> float:
    # int8 uses the restricted range [-127, 127] (scale = absmax / 127, as LLM.int8() and
    # llama.cpp's Q8_0): the extremes are exact, nothing clamps, and W, -W quantize to exact
    # negatives; code 0 (-128) goes unused, 0.4% of resolution at 8 bits. int4 follows GPTQ's
    # quantizer (scale = 2 * absmax / 15 around zero point 8): the extremes land half a step
    # outside the +-7 grid, so their error is scale / 2 like every other weight's, and the step
    # is 7% finer than absmax / 7; it also keeps our RTN equal to GPTQ without error feedback.
    return 127.0 if bits == 8 else (2**bits - 1) / 2


def _round_up_to_dtype(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The checkpoint stores scales in `dtype` (fp16 for GPTQ). Rounding them *up* keeps every
    # weight inside the grid, so the RTN bound |W - W_hat| <= scale / 2 holds for the scale that
    # is actually stored, and codes are computed against that scale, not a finer fp32 one.
    stored = scales.to(dtype)
    if not torch.isfinite(stored).all():
        raise QuantizationError(
            f"weights too large for {dtype} scales; pass scale_dtype=torch.float32")
    low = stored.to(torch.float32) < scales
    bumped = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    return torch.where(low, bumped, stored)


def compute_scales_zeros(w: torch.Tensor, bits: int, sym: bool,
                         scale_dtype: torch.dtype = torch.float16
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of `w` [..., group_len] (the last axis is one group).

    Asymmetric ranges are widened to contain 0, as GPTQ's quantizer does: 0.0 stays exactly
    representable, and an all-positive group cannot push the zero point out of 0 .. 2**bits-1
    (which would clamp codes and break the scale / 2 error bound).
    """
    _check_bits(bits)
    maxq = 2**bits - 1
    w = w.to(torch.float32)
    if sym:
        absmax = w.abs().amax(dim=-1)
        absmax = torch.where(absmax == 0, torch.ones_like(absmax), absmax)  # all-zero group
        scales = absmax / _sym_divisor(bits)
        zeros = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.int32)
        return _round_up_to_dtype(scales, scale_dtype), zeros
    xmin = w.amin(dim=-1).clamp(max=0)
    xmax = w.amax(dim=-1).clamp(min=0)
    empty = xmin == xmax  # only when the group is all zeros; any scale reproduces it exactly
    xmin = torch.where(empty, -torch.ones_like(xmin), xmin)
    xmax = torch.where(empty, torch.ones_like(xmax), xmax)
    scales = _round_up_to_dtype((xmax - xmin) / maxq, scale_dtype)
    zeros = torch.round(-xmin / scales.to(torch.float32)).clamp(0, maxq).to(torch.int32)
    return scales, zeros


def round_to_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bits: int) -> torch.Tensor:
    """codes = clamp(round(w / scale) + zero, 0, 2**bits - 1); scales/zeros broadcast onto w."""
    q = torch.round(w.to(torch.float32) / scales.to(torch.float32)) + zeros.to(torch.float32)
    return q.clamp(0, 2**bits - 1).to(torch.uint8)


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                 scale_dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """Round-to-nearest quantization of a Linear weight [out_features, in_features].

    Per-channel int8 is `bits=8, group_size=-1`; GPTQ-style int4 is `bits=4, group_size=128`.
    Every element satisfies |W - W_hat| <= scale / 2 of its group.
    """
    _check_bits(bits)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise QuantizationError(f"expected a 2-D floating-point weight, got {weight.dim()}-D "
                                f"{weight.dtype}")
    if not torch.isfinite(weight).all():
        raise QuantizationError("weight has inf or NaN values")
    out_features, in_features = weight.shape
    group_len = check_group_size(in_features, group_size)
    groups = weight.reshape(out_features, in_features // group_len, group_len)
    scales, zeros = compute_scales_zeros(groups, bits, sym, scale_dtype)
    codes = round_to_codes(groups, scales.unsqueeze(-1), zeros.unsqueeze(-1), bits)
    return QuantizedWeight(codes=codes.reshape(out_features, in_features), scales=scales,
                           zeros=zeros, bits=bits, group_size=group_size, sym=sym)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference math every kernel and checkpoint reader must reproduce:
    W_hat = (codes - zero) * scale per group, computed in fp32 (exact for fp16/bf16 scales)."""
    q = qw.codes.to(torch.int32).reshape(qw.out_features, qw.n_groups, qw.group_len)
    w = (q - qw.zeros.unsqueeze(-1)).to(torch.float32) * qw.scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(qw.out_features, qw.in_features).to(dtype)
