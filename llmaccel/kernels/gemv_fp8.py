"""Batch-1 FP8 W8A8 GEMV with the decode layer's neighbours fused in.

y[n] = (sum_k a_q[k] * w[n, k]) * s_a * s_w[n] (+ b[n]), for E4M3 weights `w` [N, K] with one
fp32 scale per row (FP8_DYNAMIC's layout, `kernels/fp8_ref.py`) and the one activation row `a`
quantized per token on the fly, exactly as the unfused engine path does it
(`quantize_fp8_per_token` then `fp8_linear`'s product), optionally with
- an RMSNorm prologue (`norm_weight`: `a` = RMSNorm(x), x being the residual stream),
- a SiLU-and-mul prologue (`silu`: x = [gate | up], `a` = silu(gate) * up),
- a residual epilogue (`residual`, updated in place to residual + y),
each rounded at the same points as the separate layers (`gemm._input_tile`, `rms_norm`,
`silu_and_mul`), so a fused decode layer equals the unfused one up to fp32 summation order.

At M == 1 every weight byte is read once, so the kernel is memory-bound only if a weight costs
few instructions: an H100 streams about 14 bytes per SM per cycle, leaving roughly eight issue
slots per e4m3 weight. Each program owns BLOCK_N rows and streams them over K in 16-byte vectors
(one [BLOCK_N, BLOCK_K / 16, 16] tile per step, the 16 bytes of a vector in one thread); a
weight costs an fp8 -> fp32 convert and an FFMA, and each vector's 16 products are summed
in-thread, so the accumulator holds one fp32 per row and vector, not per weight.

The activation scale needs the absmax of the whole (prologued) row before the first product:
every program makes one pass over x for it (two with RMSNorm, whose rstd comes first). The row
is a hidden-size vector in L2; one program per BLOCK_N rows keeps these passes cheap next to the
BLOCK_N * K weight bytes. In the main loop each thread re-derives the quantized activations of
its columns once for all the rows it holds:

- division: `a / s_a` must round like torch's true division (`kernels.fp8_ref.divide_fp32`); Triton's `/` is an
  approximate division on the GPU, and div.rn per element is a long sequence with a slow-path
  branch. With r = RN(1 / s_a) computed once, q = RN(a * r) is within an ulp of a / s_a, and
  one Markstein correction, q + (a - q * s_a) * r in two FMAs (the remainder is exact in an
  FMA), rounds correctly (Markstein's theorem; the tests check every finite bf16 and fp16
  value against torch's division for a range of scales).
- rounding to e4m3 without a conversion: adding c = 2^(max(e, -6) + 20) to |q| (e its binary
  exponent) leaves the sum an ulp of 2^(max(e, -6) - 3), e4m3's spacing at |q| (subnormals
  included), so fp32's round-to-nearest-even rounds |q| onto the e4m3 grid, ties to even; taking
  c away again is exact. The activation stays in fp32 (every e4m3 value is exact there) and
  needs no fp8 round trip. This is also the only path that is exact in Triton's interpreter,
  whose float -> fp8 cast rounds ties away and drops mantissa carries (see `kernels/cache.py`).
  No clamp to +-448: |a| <= absmax makes |q| <= 448 up to one rounding, which the grid rounds
  to 448 (`quantize_fp8_per_token` skips it for the same reason).

(The quantizer and the epilogue helpers are in `gemv_common.py`, shared with the int4 GEMV.)
Products of two e4m3 values are exact in fp32, so the result differs from `fp8_gemv_ref` only in
fp32 summation order (and, in the interpreter, in its bf16 roundings, which truncate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.gemv_common import _act_scale, _out_rows, _quantize, _silu_mul, _silu_out
from llmaccel.kernels.pdl import pdl_launch_dependents, pdl_wait
from llmaccel.kernels.fp8_ref import FP8_DTYPE, MIN_ACT_SCALE, fp8_linear_ref

VEC = 16  # e4m3 weights per vector load: 16 bytes, the widest global load
_VEC = tl.constexpr(VEC)
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _ld(ptr, mask, EVEN_K: tl.constexpr):
    """A load that needs its mask only when K has a tail."""
    if EVEN_K:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    return v


@triton.jit
def _cols(k0, BLOCK_K: tl.constexpr):
    """The columns k0.. of a tile as [BLOCK_K / VEC, VEC], a vector per row of the result."""
    return k0 + tl.arange(0, BLOCK_K // _VEC)[:, None] * _VEC + tl.arange(0, _VEC)[None, :]


@triton.jit
def _load_w(W, w_row, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The e4m3 weight tile [BLOCK_N, BLOCK_K / VEC, VEC] at k0 (rows clamped: no row mask)."""
    rk = _cols(k0, BLOCK_K)
    return _ld(W + w_row[:, None, None] + rk[None, :, :], (rk < K)[None, :, :], EVEN_K)


@triton.jit
def _act(X, NormW, k0, K, rstd, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr,
         BLOCK_K: tl.constexpr):
    """The activation tile at k0 after the prologue, in x's dtype (zeros past K), rounded as
    the unfused layers round: 0 none; 1 RMSNorm (x * rstd rounded, times the norm weight,
    rounded); 2 SiLU-and-mul (x = [gate | up]: silu(gate) rounded, times up, rounded)."""
    rk = _cols(k0, BLOCK_K)
    m = rk < K
    dt = X.dtype.element_ty
    if PROLOGUE == 2:
        a = _silu_mul(_ld(X + rk, m, EVEN_K).to(tl.float32),
                      _ld(X + K + rk, m, EVEN_K).to(tl.float32), dt)
    else:
        a = _ld(X + rk, m, EVEN_K)
        if PROLOGUE == 1:
            nw = _ld(NormW + rk, m, EVEN_K).to(tl.float32)
            normed = (a.to(tl.float32) * rstd).to(dt).to(tl.float32)
            a = (nw * normed).to(dt)
    return a


@triton.jit
def _gemv_fp8_kernel(
    X, W, WScale, Bias, NormW, Y,
    N, K, stride_wn, eps, min_scale,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_R: tl.constexpr,
    EVEN_R: tl.constexpr, SILU_OUT: tl.constexpr,
):
    rows = _out_rows(N, BLOCK_N, SILU_OUT)
    w_row = rows * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K // _VEC), tl.float32)
    if USE_PDL:
        # Weights are read-only during a step: start streaming the first tile while the
        # previous kernel (which produces X) finishes.
        w_first = _load_w(W, w_row, 0, K, EVEN_K, BLOCK_K)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    # The passes over the row below sit on the critical path after the wait, and each load
    # is an L2 round trip: they take the row in chunks of BLOCK_R (usually all of it at once).
    rstd = 0.0
    if PROLOGUE == 1:
        # as rms_norm: rstd = rsqrt(sum(x^2) / K + eps) over the whole row, in fp32
        sq = tl.zeros((BLOCK_R // _VEC, _VEC), tl.float32)
        for k0 in range(0, K, BLOCK_R):
            rk = _cols(k0, BLOCK_R)
            h = _ld(X + rk, rk < K, EVEN_R).to(tl.float32)
            sq += h * h
        rstd = tl.rsqrt(tl.sum(tl.sum(sq, axis=1), axis=0) / K + eps)
    if PROLOGUE == 3:
        # X is quantized already (`quantize_row_fp8`): e4m3 values, the scale at NormW
        scale = tl.load(NormW)
        rcp = 1.0
    else:
        # the per-token scale from the prologued row's absmax
        amax = tl.zeros((BLOCK_R // _VEC, _VEC), tl.float32)
        for k0 in range(0, K, BLOCK_R):
            a = _act(X, NormW, k0, K, rstd, PROLOGUE, EVEN_R, BLOCK_R)
            amax = tl.maximum(amax, tl.abs(a.to(tl.float32)))
        scale, rcp = _act_scale(tl.max(tl.max(amax, axis=1), axis=0), min_scale)
    k_start = 0
    if USE_PDL:
        a_q = _quantize(_act(X, NormW, 0, K, rstd, PROLOGUE, EVEN_K, BLOCK_K), scale, rcp,
                        PROLOGUE)
        acc += tl.sum(w_first.to(tl.float32) * a_q[None, :, :], axis=2)
        k_start = BLOCK_K
    for k0 in tl.range(k_start, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _load_w(W, w_row, k0, K, EVEN_K, BLOCK_K)
        a_q = _quantize(_act(X, NormW, k0, K, rstd, PROLOGUE, EVEN_K, BLOCK_K), scale, rcp,
                        PROLOGUE)
        # the 16 products of a vector sum in-thread (FFMAs); one accumulator per vector
        acc += tl.sum(w.to(tl.float32) * a_q[None, :, :], axis=2)
    # (sum * s_a) * s_w, rounded to x's dtype: fp8_ref.fp8_product_ref's order
    y = tl.sum(acc, axis=1) * scale * tl.load(WScale + rows)
    dt = Y.dtype.element_ty
    y = y.to(dt)
    if HAS_BIAS:  # added after the cast, in x's dtype, as fp8_linear does
        y = (y.to(tl.float32) + tl.load(Bias + rows).to(tl.float32)).to(dt)
    if SILU_OUT:
        _silu_out(y, Y, N, BLOCK_N)
    else:
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        if RESIDUAL:  # Y holds the residual stream: residual + y, rounded once more
            y = (y.to(tl.float32) + tl.load(Y + rn, mask=mask_n, other=0.0).to(tl.float32)
                 ).to(dt)
        tl.store(Y + rn, y, mask=mask_n)


@triton.jit
def _quantize_row_kernel(X, Q, S, K, min_scale, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    rk = tl.arange(0, BLOCK)
    a = tl.load(X + rk, mask=rk < K, other=0.0).to(tl.float32)
    scale, rcp = _act_scale(tl.max(tl.abs(a), axis=0), min_scale)
    tl.store(Q + rk, _quantize(a, scale, rcp).to(Q.dtype.element_ty), mask=rk < K)
    tl.store(S, scale)


def quantize_row_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One activation row -> (its e4m3 codes as values in x's dtype, the fp32 scale [1]), as
    `quantize_fp8_per_token` computes them, in one program: what `fp8_gemv(x_scale=...)`
    takes, so that the GEMV's programs do not each redo the row's absmax and quantization.
    (Every e4m3 value is exact in bf16, fp16 and fp32.)"""
    width = x.shape[-1]
    if x.numel() != width or width == 0 or width > 65536:
        raise ValueError(f"quantize_row_fp8 takes one row of at most 65536, got {tuple(x.shape)}")
    q = torch.empty_like(x)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(width)
    _quantize_row_kernel[(1,)](x.reshape(-1).contiguous(), q, scale, width, MIN_ACT_SCALE,
                               BLOCK=block, USE_PDL=pdl.enabled(),
                               num_warps=max(1, min(16, block // 512)), **pdl.launch_kwargs())
    return q, scale


@dataclass(frozen=True)
class GemvFp8Config:
    block_n: int
    block_k: int  # a power of two >= 16 (whole 16-byte vectors)
    num_warps: int = 4
    num_stages: int = 3
    # quantize the row once in its own kernel (`quantize_row_fp8`) and run the GEMV on it,
    # instead of every program deriving the scale and codes itself (not with a prologue)
    prequant: bool = False

    def describe(self) -> str:
        return (f"n{self.block_n}k{self.block_k}-w{self.num_warps}s{self.num_stages}"
                + ("-q" if self.prequant else ""))


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def valid_config(cfg: GemvFp8Config) -> bool:
    """Powers of two, BLOCK_K whole 16-byte vectors, at least one pipeline stage."""
    return (_pow2(cfg.block_n) and _pow2(cfg.block_k) and cfg.block_k >= VEC
            and _pow2(cfg.num_warps) and cfg.num_stages >= 1)


def default_gemv_fp8_config(n: int, k: int) -> GemvFp8Config:
    """The untuned tile (not yet measured on a GPU: `benchmarks/bench_fp8_gemv.py` tunes per
    shape): 512 columns a step (one 16-byte vector per thread of a warp), 16 rows a program
    where N leaves at least about two programs per H100 SM, else 8."""
    block_k = max(VEC, min(512, triton.next_power_of_2(k)))
    return GemvFp8Config(block_n=16 if n >= 4096 else 8, block_k=block_k, num_warps=4,
                         num_stages=3)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, norm_weight: torch.Tensor | None, silu: bool,
           residual: torch.Tensor | None, silu_out: bool = False) -> tuple[int, int]:
    """Validates the arguments of `fp8_gemv`; returns (N, K)."""
    width = x.shape[-1] if x.dim() else 0
    if x.numel() != width or width == 0:
        raise ValueError(f"fp8_gemv takes exactly one row of x, got {tuple(x.shape)}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if silu and norm_weight is not None:
        raise ValueError("one prologue at a time: silu or norm_weight")
    if silu and width % 2:
        raise ValueError(f"with silu x is [gate | up], 2K wide: got an odd width {width}")
    k = width // 2 if silu else width
    if (weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.shape[1] != k
            or weight.stride(-1) != 1):
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} is not "
                         f"{FP8_DTYPE} [N, K] with contiguous rows for K={k}")
    n = weight.shape[0]
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) not in ((n, 1), (n,)):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype} must "
                         f"be fp32 [N, 1] or [N] for N={n}")
    for name, t, size in (("bias", bias, n), ("norm_weight", norm_weight, k)):
        if t is not None and (t.shape != (size,) or t.dtype != x.dtype):
            raise ValueError(f"{name} must be [{size}] in {x.dtype}, got {tuple(t.shape)} "
                             f"{t.dtype}")
    if silu_out and (silu or residual is not None or n % 2):
        raise ValueError("silu_out needs an even N ([gate; up] rows), no silu prologue and no "
                         "residual")
    if residual is not None and (residual.shape != (*x.shape[:-1], n)
                                 or residual.dtype != x.dtype or not residual.is_contiguous()):
        raise ValueError(f"residual must be contiguous {(*x.shape[:-1], n)} in {x.dtype}")
    return n, k


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, config: GemvFp8Config | None = None, *,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu: bool = False,
             residual: torch.Tensor | None = None, silu_out: bool = False,
             x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] holding exactly one row ([..., 2K] = [gate | up] with `silu`) -> y [..., N]
    in x's dtype: `fp8_linear(prologue(x), weight, weight_scale, bias)` for e4m3 `weight`
    [N, K] and fp32 `weight_scale` [N, 1] or [N]. `norm_weight` [K] (with `eps`) or `silu`
    fuse RMSNorm or SiLU-and-mul before it; `residual` [..., N] is updated in place to
    residual + y and returned; `silu_out` (a [gate; up] layer, N = 2I) returns
    silu_and_mul(y) [..., I] instead of y, the activation in the epilogue. With `x_scale`
    (fp32 [1]) x is the quantized row already (`quantize_row_fp8`; no prologue then). Rounds
    as `fp8_gemv_ref` (module docstring)."""
    n, k = _check(x, weight, weight_scale, bias, norm_weight, silu, residual, silu_out)
    if (config is not None and config.prequant and x_scale is None and not silu
            and norm_weight is None and n and k):
        x, x_scale = quantize_row_fp8(x)
    if x_scale is not None and (silu or norm_weight is not None or x_scale.numel() != 1
                                or x_scale.dtype != torch.float32):
        raise ValueError("x_scale (fp32, one value) takes a quantized row: no prologue")
    cfg = config or default_gemv_fp8_config(n, k)
    if not valid_config(cfg) or (silu_out and cfg.block_n < 2):
        raise ValueError(f"config {cfg.describe()} is invalid: powers of two, block_k >= {VEC}"
                         + (", block_n >= 2 for silu_out" if silu_out else ""))
    n_out = n // 2 if silu_out else n
    y = residual if residual is not None else torch.empty(*x.shape[:-1], n_out, dtype=x.dtype,
                                                          device=x.device)
    if n == 0:
        return y
    x1 = x.reshape(-1).contiguous()
    # the chunk of the row-wide passes (absmax, RMSNorm): the whole row up to 8192 columns
    block_r = max(VEC, min(8192, triton.next_power_of_2(k)))
    dummy = weight  # pointer arguments the constexpr flags switch off
    grid = triton.cdiv(n // 2, cfg.block_n // 2) if silu_out else triton.cdiv(n, cfg.block_n)
    _gemv_fp8_kernel[(grid,)](
        x1, weight, weight_scale.reshape(n).contiguous(),
        bias if bias is not None else dummy,
        x_scale if x_scale is not None else (
            norm_weight.contiguous() if norm_weight is not None else dummy), y,
        n, k, weight.stride(0), eps, MIN_ACT_SCALE,
        PROLOGUE=3 if x_scale is not None else (1 if norm_weight is not None else (
            2 if silu else 0)),
        HAS_BIAS=bias is not None, RESIDUAL=residual is not None,
        EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, USE_PDL=pdl.enabled(),
        BLOCK_R=block_r, EVEN_R=k % block_r == 0, SILU_OUT=silu_out,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(),
    )
    return y


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, silu: bool = False,
                 residual: torch.Tensor | None = None, silu_out: bool = False) -> torch.Tensor:
    """PyTorch reference of `fp8_gemv`: the unfused layers in order (RMSNorm / SiLU-and-mul,
    the fp32 W8A8 reference product, residual add in place, or SiLU-and-mul after)."""
    from llmaccel.kernels.activation import silu_and_mul_ref
    from llmaccel.kernels.rmsnorm import rms_norm_ref

    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    if silu:
        x = silu_and_mul_ref(x)
    y = fp8_linear_ref(x, weight, weight_scale.reshape(-1, 1), bias)
    if silu_out:
        return silu_and_mul_ref(y)
    if residual is None:
        return y
    residual.copy_(y + residual)
    return residual


__all__ = ["GemvFp8Config", "default_gemv_fp8_config", "fp8_gemv", "fp8_gemv_ref",
           "quantize_row_fp8", "valid_config"]
