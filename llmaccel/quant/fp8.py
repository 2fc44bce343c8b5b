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
from torch import nn

from llmaccel.errors import QuantizationError
from llmaccel.kernels.fp8_ref import (FP8_DTYPE, FP8_MAX, MIN_ACT_SCALE,  # noqa: F401 - public
                                      dequantize_fp8, over_fp8_max, quantize_fp8_per_token,
                                      to_fp8)

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
    scale = torch.where(absmax > 0, over_fp8_max(absmax), torch.ones_like(absmax))
    return Fp8Weight(to_fp8(w, scale), scale.contiguous(), strategy)


def fake_quantize_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x after the per-token E4M3 round trip, in fp32: what the W8A8 product actually sees."""
    q, scale = quantize_fp8_per_token(x)
    return dequantize_fp8(q, scale)


@dataclass(frozen=True)
class Fp8LinearQuant:
    """`layerwise.LinearQuant`'s counterpart for FP8: what the driver packs for one linear."""

    qweight: Fp8Weight

    def dequantize(self) -> torch.Tensor:
        return self.qweight.dequantize()


def _fake_quantize_input(_module: nn.Module, args: tuple) -> tuple:
    return (fake_quantize_fp8_per_token(args[0]).to(args[0].dtype), *args[1:])


@torch.no_grad()
def quantize_linears_fp8(layer: nn.Module, names: tuple[str, ...]) -> dict[str, Fp8LinearQuant]:
    """FP8_DYNAMIC on the named linears of an HF decoder layer, in place: each weight becomes
    its dequantized E4M3 value and each input is fake-quantized per token (a forward pre-hook),
    so the layer's forward afterwards is what a W8A8 reader of the checkpoint computes."""
    out: dict[str, Fp8LinearQuant] = {}
    for name in names:
        lin = layer.get_submodule(name)
        qw = quantize_fp8_weight(lin.weight.data, "channel")
        lin.weight.data.copy_(qw.dequantize(lin.weight.dtype))
        lin.register_forward_pre_hook(_fake_quantize_input)
        out[name] = Fp8LinearQuant(qw)
    return out


def check_fp8_settings(fmt: str | None, bits: int | None, sym: bool | None) -> str:
    """The checkpoint format for `quantize --method fp8`; refuses flags that contradict it
    (FP8 is always 8-bit E4M3, symmetric, one scale per output channel)."""
    if bits is not None and bits != 8:
        raise QuantizationError(f"fp8 stores 8-bit E4M3 weights: leave --bits out or pass 8, "
                                f"got {bits}")
    if sym is False:
        raise QuantizationError("fp8 is symmetric (no zero points): --asym does not apply")
    if fmt not in (None, "compressed-tensors"):
        raise QuantizationError(f"fp8 checkpoints are written as compressed-tensors "
                                f"float-quantized, got format {fmt!r}")
    return "compressed-tensors"


__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_ACT_SCALE", "Fp8LinearQuant", "Fp8Weight",
           "check_fp8_settings", "dequantize_fp8", "fake_quantize_fp8_per_token",
           "over_fp8_max", "quantize_fp8_per_token", "quantize_fp8_weight",
           "quantize_linears_fp8", "to_fp8"]
