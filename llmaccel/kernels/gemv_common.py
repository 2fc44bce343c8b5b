"""Triton helpers the batch-1 GEMVs share (`gemv_fp8.py`, `gemv_w4.py`): SiLU-and-mul and the
FP8 activation quantizer rounded as the unfused layers round, and the interleaved [gate; up]
rows of a SiLU epilogue.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmaccel.kernels.fp8_ref import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # 448: the activation scale is absmax / 448


@triton.jit
def _silu_mul(gate, up, dt: tl.constexpr):
    """silu(gate) * up from fp32 inputs, rounded to dt as silu_and_mul rounds (the SiLU, then
    the product)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    return (act * up).to(dt)


@triton.jit
def _act_scale(absmax, min_scale):
    """The per-token scale and its reciprocal, as quantize_fp8_per_token:
    max(absmax / 448, MIN_ACT_SCALE), both correctly rounded divisions."""
    scale = tl.maximum(tl.div_rn(absmax, tl.full((), _FP8_MAX, tl.float32)), min_scale)
    return scale, tl.div_rn(tl.full((), 1.0, tl.float32), scale)


@triton.jit
def _quantize(a, scale, rcp, PROLOGUE: tl.constexpr = 0):
    """e4m3(a / scale) as exact fp32 values (module docstring): correctly rounded division,
    then rounding onto the e4m3 grid, ties to even. PROLOGUE 3: `a` is quantized already."""
    if PROLOGUE == 3:
        return a.to(tl.float32)
    af = a.to(tl.float32)
    q = af * rcp
    q = tl.fma(tl.fma(-q, scale, af), rcp, q)  # Markstein: RN(af / scale)
    mag = tl.abs(q)
    expo = tl.maximum(mag.to(tl.int32, bitcast=True) & 0x7F800000, 121 << 23)  # >= 2^-6
    c = (expo + (20 << 23)).to(tl.float32, bitcast=True)  # 2^(max(e, -6) + 20)
    mag = (mag + c) - c
    return tl.where(q < 0, -mag, mag)


@triton.jit
def _out_rows(N, BLOCK_N: tl.constexpr, SILU_OUT: tl.constexpr):
    """The weight rows of this program's tile. With SILU_OUT the layer is [gate; up] (N = 2I)
    and the tile interleaves them, gate row j then up row j for BLOCK_N / 2 outputs j, so the
    epilogue pairs rows without leaving registers. Rows past the end re-read the last valid
    one (their results are not stored): no mask on weight loads."""
    r = tl.arange(0, BLOCK_N)
    if SILU_OUT:
        half = N // 2
        j = tl.program_id(0) * (BLOCK_N // 2) + r // 2
        rows = tl.minimum(j, half - 1) + (r % 2) * half
    else:
        rows = tl.minimum(tl.program_id(0) * BLOCK_N + r, N - 1)
    return rows.to(tl.int64)


@triton.jit
def _silu_out(y, Y, N, BLOCK_N: tl.constexpr):
    """SILU_OUT's epilogue: y [BLOCK_N] holds (gate, up) pairs, already rounded to Y's dtype
    as the layer's output would be; stores silu(gate) * up rounded as silu_and_mul rounds."""
    dt = Y.dtype.element_ty
    gate, up = tl.split(tl.reshape(y.to(tl.float32), (BLOCK_N // 2, 2)))
    out = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(Y + out, _silu_mul(gate, up, dt), mask=out < N // 2)
