"""Triton SwiGLU gate: silu(x[..., :n]) * x[..., n:] on the fused gate_up projection output.

Fuses the split, the silu and the multiply into one pass over [T, 2n] (eager PyTorch makes an
intermediate for silu(gate) and reads it back). Grid: one program per (row, BLOCK columns).
Rounding follows `llmaccel.models.layers.activation.SiluAndMul`: silu computed in fp32 and
rounded to the input dtype, then multiplied by `up` and rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.pdl import pdl_enter


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, n, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x [..., 2n] -> [..., n] = silu(x[..., :n]) * x[..., n:]; x is not modified."""
    two_n = x.shape[-1]
    assert two_n % 2 == 0
    n = two_n // 2
    rows = x.reshape(-1, two_n)
    assert rows.stride(-1) == 1
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, n)
    if rows.shape[0] == 0 or n == 0:
        return out
    block = min(block, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
        rows, o2, rows.stride(0), o2.stride(0), n, BLOCK=block, USE_PDL=pdl.enabled(),
        num_warps=4, **pdl.launch_kwargs())
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: the exact math of `SiluAndMul.forward`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
