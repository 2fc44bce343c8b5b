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


def over_fp8_max(t: torch.Tensor) -> torch.Tensor:
    """t / 448, correctly rounded on every device. CUDA turns division by a Python scalar into
    multiplication by its reciprocal, which can be 1 ulp off; that moves activations lying
    exactly between two e4m3 values (frequent with bf16 inputs) to the other side, so a GPU and
    a CPU run would quantize the same x differently. A tensor divisor keeps true division."""
    return t / torch.full_like(t, FP8_MAX)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale) with saturation; `scale` broadcasts onto x. True division in fp32, not
    multiplication by 1 / scale, so every path (reference, _scaled_mm, the tests) rounds alike."""
    return _divide_fp32(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _divide_fp32(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale = scale.to(torch.float32)
    # x / scale promotes a bf16/fp16 x to fp32 inside the one division kernel (no fp32 copy of
    # x first); a 0-d scale would not promote, so then x is converted explicitly.
    return x / scale if scale.dim() > 0 else x.to(torch.float32) / scale


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
    scale = torch.where(absmax > 0, over_fp8_max(absmax), torch.ones_like(absmax))
    return Fp8Weight(to_fp8(w, scale), scale.contiguous(), strategy)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of activations [..., K]: (e4m3 x_q [..., K], fp32
    scales [..., 1]) with scale = max(absmax(row) / 448, MIN_ACT_SCALE). No host sync, so it
    runs inside CUDA graphs."""
    # abs + amax rather than one vector_norm(inf) kernel: the same bits (a max rounds nothing)
    # at a fraction of vector_norm's host overhead, which dominated small-batch calls
    absmax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = over_fp8_max(absmax).clamp_min_(MIN_ACT_SCALE)
    # no clamp to +-448 needed: |x| / scale <= 448 up to one rounding, and e4m3 rounds anything
    # below 464 to 448, so this saves a full pass over x
    return _divide_fp32(x, scale).to(FP8_DTYPE), scale


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
