"""Triton helpers the batch-1 GEMVs share (`gemv_fp8.py`, `gemv_w4.py`): SiLU-and-mul and the
FP8 activation quantizer rounded as the unfused layers round, the interleaved [gate; up] rows of
a SiLU epilogue, and the row-norm tail.

The row-norm tail (`RowNormTail`, `_norm_tail`) is the next RMSNorm run by the GEMV's last
program. A decode layer's o and down products end in the residual add, and the next thing the
step does is RMSNorm that residual row (then, for an FP8 consumer, quantize it). Those are one-
program kernels that cost about a launch each on a GPU, two or four per layer; folding the norm
into the consumer GEMV's prologue instead made every program redo it, which measured 1.9x
slower on int4 (2026-11-23-fused-decode-quant-h100). Here each program, once its rows are
stored, takes a ticket from an int32 counter (an acq_rel atomic after a CTA barrier, so the
program's stores are visible to whoever takes a later ticket); the program with the last ticket
reads the finished row from L2, normalizes it (and quantizes it) and resets the counter for the
next launch. The row is rounded exactly as `kernels/rmsnorm.py` (and `quantize_row_fp8`) round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmaccel.quant.fp8 import FP8_MAX

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

@triton.jit
def _tail_row(Y, TailW, r, N, rstd):
    """RMSNorm of the finished row at columns r, rounded as rms_norm rounds (x * rstd to
    the row's dtype, times the weight, rounded again), in fp32; zeros past N."""
    dt = Y.dtype.element_ty
    m = r < N
    h = tl.load(Y + r, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    w = tl.load(TailW + r, mask=m, other=0.0).to(tl.float32)
    return (w * (h * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _norm_tail(Y, N, Counter, TailW, TailOut, TailScale, eps, min_scale,
               TAIL: tl.constexpr, BLOCK_T: tl.constexpr):
    """After this program stored its part of the row Y [N]: the program that finishes last
    writes TailOut = RMSNorm(Y) * TailW (TAIL 1) or that row quantized to e4m3 values, with
    its fp32 scale at TailScale (TAIL 2, as quantize_row_fp8). Module docstring."""
    tl.debug_barrier()  # every thread's stores precede the ticket (a CTA-wide release)
    ticket = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        dt = Y.dtype.element_ty
        if BLOCK_T >= N:
            # the whole row in one load of it and of the weight: one L2 round trip, since
            # the tail is a serial stretch that the whole step waits for
            r = tl.arange(0, BLOCK_T)
            m = r < N
            h = tl.load(Y + r, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(TailW + r, mask=m, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
            xn = (w * (h * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            if TAIL == 2:
                scale, rcp = _act_scale(tl.max(tl.abs(xn), axis=0), min_scale)
                tl.store(TailOut + r, _quantize(xn, scale, rcp).to(dt), mask=m)
                tl.store(TailScale, scale)
            else:
                tl.store(TailOut + r, xn.to(dt), mask=m)
        else:  # wider rows in chunks: a pass for rstd, one for the absmax, one to store
            sq = tl.zeros((BLOCK_T,), tl.float32)
            for k0 in range(0, N, BLOCK_T):
                r = k0 + tl.arange(0, BLOCK_T)
                h = tl.load(Y + r, mask=r < N, other=0.0, cache_modifier=".cg").to(tl.float32)
                sq += h * h
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / N + eps)
            scale, rcp = 1.0, 1.0
            if TAIL == 2:
                amax = tl.zeros((BLOCK_T,), tl.float32)
                for k0 in range(0, N, BLOCK_T):
                    r = k0 + tl.arange(0, BLOCK_T)
                    amax = tl.maximum(amax, tl.abs(_tail_row(Y, TailW, r, N, rstd)))
                scale, rcp = _act_scale(tl.max(amax, axis=0), min_scale)
                tl.store(TailScale, scale)
            for k0 in range(0, N, BLOCK_T):
                r = k0 + tl.arange(0, BLOCK_T)
                xn = _tail_row(Y, TailW, r, N, rstd)
                if TAIL == 2:
                    xn = _quantize(xn, scale, rcp)
                tl.store(TailOut + r, xn.to(dt), mask=r < N)
        tl.atomic_xchg(Counter, 0)  # ready for the next launch (which waits for this one)


@dataclass(frozen=True)
class RowNormTail:
    """What a GEMV with a residual epilogue computes after it (`_norm_tail`): `out` [N] =
    RMSNorm(residual) * `weight` with `eps`, or with `scale` (fp32 [1]) that row quantized
    to e4m3 values (in `out`'s dtype, as `quantize_row_fp8`) and its scale. `counter` is an
    int32 [1] that is zero before the launch and is left zero; launches that may overlap need
    their own."""
    weight: torch.Tensor
    eps: float
    counter: torch.Tensor
    out: torch.Tensor
    scale: torch.Tensor | None = None

    def check(self, residual: torch.Tensor) -> None:
        n = residual.shape[-1]
        if (self.weight.shape != (n,) or self.out.numel() != n or self.out.dtype
                != residual.dtype or not self.out.is_contiguous()):
            raise ValueError(f"the norm tail needs a weight [{n}] and a contiguous output of "
                             f"{n} in {residual.dtype}")
        if self.counter.dtype != torch.int32 or self.counter.numel() < 1:
            raise ValueError("the norm tail's counter must be int32")
        if self.scale is not None and (self.scale.dtype != torch.float32
                                       or self.scale.numel() != 1):
            raise ValueError("the norm tail's scale must be fp32 [1]")

    def launch_args(self) -> dict:
        """The kernels' tail arguments (TAIL 1: normalized row, 2: quantized too)."""
        n = self.out.numel()
        return dict(TAIL=2 if self.scale is not None else 1,
                    BLOCK_T=min(TAIL_ROW_MAX, triton.next_power_of_2(n)))

    def pointers(self) -> tuple:
        """(Counter, TailW, TailOut, TailScale) for the kernel."""
        return (self.counter, self.weight, self.out,
                self.scale if self.scale is not None else self.counter)


NO_TAIL = dict(TAIL=0, BLOCK_T=1)
# Rows up to this width are normalized in one load (every hidden size of the llama-3.2 and
# qwen2.5 families); wider ones in chunks of it. Module attribute: the tests lower it.
TAIL_ROW_MAX = 8192
