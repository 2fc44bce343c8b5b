"""FP8 (E4M3) quantization: per-channel weights, dynamic per-token activations (W8A8).

The scheme is llm-compressor's FP8_DYNAMIC, which vLLM runs on Hopper/Ada tensor cores:

    weight      W_q = e4m3(W / s_w),  s_w = absmax(W[o, :]) / 448   one fp32 scale per output row
    activation  x_q = e4m3(x / s_x),  s_x = absmax(x[t, :]) / 448   one fp32 scale per token,
                                                                      computed at run time
    product     y[t, o] = (sum_k x_q[t, k] * W_q[o, k]) * s_x[t] * s_w[o]

e4m3 is torch.float8_e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no inf, NaN
at 0x7F/0xFF, largest finite 448); the cast rounds to nearest-even. Values are clamped to
+-448 first because the cast does not saturate: anything past 464 would become NaN.
No calibration is needed: weights are rounded to nearest, activations are scaled on the fly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.errors import QuantizationError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Floor of a dynamic activation scale, as vLLM's per-token quant kernels use: an all-zero token
# then quantizes to zeros instead of 0 / 0, and tiny tokens keep their sub-scale precision.
MIN_ACT_SCALE = 1.0 / (FP8_MAX * 512.0)
WEIGHT_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True)
class Fp8Weight:
    """A Linear weight in E4M3 with its fp32 scales (what the checkpoint stores)."""

    weight: torch.Tensor  # float8_e4m3fn [out_features, in_features]
    weight_scale: torch.Tensor  # fp32 [out_features, 1] ("channel") or [1] ("tensor")
    strategy: str = "channel"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)


def _check_strategy(strategy: str) -> None:
    if strategy not in WEIGHT_STRATEGIES:
        raise QuantizationError(f"fp8 weight strategy must be one of {WEIGHT_STRATEGIES}, "
                                f"got {strategy!r}")


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale) with saturation; `scale` broadcasts onto x. Division in fp32, not
    multiplication by 1 / scale, so every path (reference, _scaled_mm, the tests) rounds alike."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in fp32 (one rounding: every e4m3 value is exact in fp32), then `dtype`."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def quantize_fp8_weight(weight: torch.Tensor, strategy: str = "channel") -> Fp8Weight:
    """Round-to-nearest E4M3 of a Linear weight [out, in]: scale = absmax / 448 per output row
    ("channel", FP8_DYNAMIC) or over the whole tensor ("tensor", vLLM/AutoFP8 per-tensor)."""
    _check_strategy(strategy)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise QuantizationError(f"expected a 2-D floating-point weight, got {weight.dim()}-D "
                                f"{weight.dtype}")
    w = weight.detach().to(torch.float32)
    if not torch.isfinite(w).all():
        raise QuantizationError("weight has inf or NaN values")
    absmax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()[None]
    # an all-zero row (pruned channel) would give scale 0 and 0 / 0: any scale stores it exactly
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return Fp8Weight(to_fp8(w, scale), scale.contiguous(), strategy)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of activations [..., K]: (e4m3 x_q [..., K], fp32
    scales [..., 1]) with scale = max(absmax(row) / 448, MIN_ACT_SCALE). No host sync, so it
    runs inside CUDA graphs."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_ACT_SCALE)
    return to_fp8(xf, scale), scale


def fake_quantize_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x after the per-token E4M3 round trip, in fp32: what the W8A8 product actually sees."""
    q, scale = quantize_fp8_per_token(x)
    return dequantize_fp8(q, scale)


__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_ACT_SCALE", "Fp8Weight", "dequantize_fp8",
           "fake_quantize_fp8_per_token", "quantize_fp8_per_token", "quantize_fp8_weight",
           "to_fp8"]
