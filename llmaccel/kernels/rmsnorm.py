"""Triton RMSNorm, plain and with the fused residual add, plus their PyTorch references.

One program per row: the row is loaded once (masked up to the next power of two, so any hidden
size works), squared and summed in fp32, and the normalized row written back. The fused variant
also adds the residual first and writes the sum back into `residual` in place, saving a separate
elementwise add and one round trip of the residual stream through memory. `rms_norm_fp8` also
quantizes the normalized row per token to FP8 for a GEMV that takes it so (one kernel fewer
than norm, then `gemv_fp8.quantize_row_fp8`).

The math matches `llmaccel.models.layers.norm.RMSNorm` step for step (normalize in fp32, round
to the input dtype, then multiply by the weight and round again), so bf16/fp16 outputs match the
layer, not just approximately the fp32 math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.gemv_common import _act_scale, _quantize
from llmaccel.kernels.pdl import pdl_enter
from llmaccel.kernels.fp8_ref import MIN_ACT_SCALE


@triton.jit
def _rms_norm_kernel(
    X, Res, W, Out, Scale, stride_x, stride_r, stride_o, n_cols, eps, min_scale,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    FP8_OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The norm's weight is read-only: loaded before the PDL wait, its read (from device
    # memory: a decode step's weight stream evicts it from L2) overlaps the previous kernel
    # instead of following the row's reduction on the step's critical path.
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0)
        # x + residual in the input dtype, as the layer does, then carried on as the residual.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Res + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(X.dtype.element_ty).to(tl.float32)
    out = (w * normed).to(Out.dtype.element_ty)
    if FP8_OUT:
        # the normalized row quantized per token as quantize_fp8_per_token does it (what
        # gemv_fp8's quantize_row_fp8 would do next), while the row is in registers
        scale, rcp = _act_scale(tl.max(tl.abs(out.to(tl.float32)), axis=0), min_scale)
        out = _quantize(out, scale, rcp).to(Out.dtype.element_ty)
        tl.store(Scale + row, scale)
    tl.store(Out + row * stride_o + cols, out, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.view(-1, t.shape[-1])
    assert rows.stride(-1) == 1, "last dim must be contiguous"
    return rows


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, fp8_scale: torch.Tensor | None = None) -> torch.Tensor:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    # weight * h.to(dtype) in the layer follows torch's type promotion.
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    o2 = out.view(-1, hidden)
    if x2.shape[0] == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, o2, fp8_scale if fp8_scale is not None else weight,
        x2.stride(0), r2.stride(0), o2.stride(0), hidden, eps, MIN_ACT_SCALE,
        HAS_RESIDUAL=residual is not None, BLOCK=block, FP8_OUT=fp8_scale is not None,
        USE_PDL=pdl.enabled(), num_warps=min(max(block // 256, 1), 16), **pdl.launch_kwargs(),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> weight * rmsnorm(x), a new tensor; x is not modified."""
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual) * weight, x + residual).

    In place: `residual` is overwritten with x + residual and is the second value returned.
    `x` is left unchanged; the normalized output is a new tensor. `residual` must have x's
    shape and dtype and be viewable as rows (contiguous last dim)."""
    assert residual.shape == x.shape and residual.dtype == x.dtype
    out = _launch(x, residual, weight, eps)
    return out, residual


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, scale, residual): the RMSNorm of each row of x (of x + residual, `residual`
    updated in place as in `fused_add_rms_norm`) quantized per token to e4m3, as
    `quantize_fp8_per_token` would quantize `rms_norm`'s output: q holds the e4m3 values in
    the output dtype (exact there), scale fp32 [rows]. For an FP8 GEMV that takes its row
    quantized (`gemv_fp8.fp8_gemv(x_scale=...)`), one kernel instead of two."""
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    return _launch(x, residual, weight, eps, scale), scale, residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch reference: the exact math of `RMSNorm.forward(x)`."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: `RMSNorm.forward(x, residual)`, with the same in-place contract as
    `fused_add_rms_norm` (residual overwritten with x + residual, x unchanged)."""
    residual.copy_(x + residual)
    return rms_norm_ref(residual, weight, eps), residual
