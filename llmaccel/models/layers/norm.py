"""RMSNorm with an optional fused residual add (the residual stream is carried between layers)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.use_triton = False  # set by TransformerForCausalLM.set_fused_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x) or, with a residual, (norm(x + residual), x + residual)."""
        if self.use_triton:
            # One kernel reads x (and the residual) once; the sum goes back into `residual`.
            from llmaccel.kernels import rmsnorm
            if residual is None:
                return rmsnorm.rms_norm(x, self.weight, self.eps)
            return rmsnorm.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        # Normalize in fp32 and cast back before the weight, as HF does, so bf16 outputs match.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Like forward, but the normalized rows quantized per token to FP8, for a GEMV that
        takes them so: (QuantizedRow, residual or None). Triton kernels only."""
        from llmaccel.kernels.rmsnorm import rms_norm_fp8
        from llmaccel.models.layers.quantization import QuantizedRow

        q, scale, residual = rms_norm_fp8(x, self.weight, self.eps, residual)
        return QuantizedRow(q, scale), residual
