"""E4M3 (FP8) rounding and the W8A8 product in PyTorch: the arithmetic every FP8 kernel
matches, and its reference. Weights carry one fp32 scale per output row, activations one per
token computed at run time (llm-compressor's FP8_DYNAMIC, what vLLM runs).

e4m3 is torch.float8_e4m3fn (largest finite 448, no inf); the cast rounds to nearest-even but
does not saturate, so values are clamped to +-448 first where they could exceed it.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Floor of a dynamic activation scale, as vLLM's per-token quant kernels use: an all-zero token
# then quantizes to zeros instead of 0 / 0, and tiny tokens keep their sub-scale precision.
MIN_ACT_SCALE = 1.0 / (FP8_MAX * 512.0)


def over_fp8_max(t: torch.Tensor) -> torch.Tensor:
    """t / 448, correctly rounded on every device. CUDA turns division by a Python scalar into
    multiplication by its reciprocal, which can be 1 ulp off; that moves activations lying
    exactly between two e4m3 values (frequent with bf16 inputs) to the other side, so a GPU and
    a CPU run would quantize the same x differently. A tensor divisor keeps true division."""
    return t / torch.full_like(t, FP8_MAX)


def divide_fp32(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in fp32 (true division, as every FP8 path rounds)."""
    scale = scale.to(torch.float32)
    # x / scale promotes a bf16/fp16 x to fp32 inside the one division kernel (no fp32 copy of
    # x first); a 0-d scale would not promote, so then x is converted explicitly.
    return x / scale if scale.dim() > 0 else x.to(torch.float32) / scale


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale) with saturation; `scale` broadcasts onto x. True division in fp32, not
    multiplication by 1 / scale, so every path (reference, _scaled_mm, the tests) rounds alike."""
    return divide_fp32(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in fp32 (one rounding: every e4m3 value is exact in fp32), then `dtype`."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


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
    return divide_fp32(x, scale).to(FP8_DTYPE), scale


def fp8_product_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                    w_scale: torch.Tensor) -> torch.Tensor:
    """(x_q * x_scale) @ (w_fp8 * w_scale)^T accumulated in fp32, [tokens, N]."""
    acc = x_q.to(torch.float32) @ w_fp8.to(torch.float32).t()
    return acc * x_scale * w_scale.reshape(1, -1).to(torch.float32)


def fp8_linear_ref(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with x [..., K] quantized per token, in fp32, cast to x's dtype; the
    bias added after the cast, in that dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x_q, x_scale = quantize_fp8_per_token(x.reshape(-1, k))
    y = fp8_product_ref(x_q, x_scale, w_fp8, w_scale).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, w_fp8.shape[0])
