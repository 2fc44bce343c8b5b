"""Batch-1 W4A16 GEMV: y[n] = sum_k x[k] * (code[n, k] - zero[n, g]) * scale[n, g] (+ b[n]).

The weight layout of `kernels/gemm.py` BITS=4 (int32 [N, K/8], word w of a row holds the codes
of k = 8w..8w+7, lowest nibble first; scales [N, G]; uint8 zeros [N, G], or zero point 8 when
absent), for M == 1 only: each 4-bit weight is read once and used once, so the kernel is
memory-bound only if a weight costs few instructions (an H100 issues about four per weight at
full HBM bandwidth). Here it costs a LOP3, an FADD and an FFMA, nothing for zero or scale:

- Nibble to float without a shift or an int-to-float convert: nibble p of a word is
  `word & (0xF << 4p)` = code * 2^(4p). OR-ing in the bit pattern of 2^(23-4p) (exponent field
  150-4p, empty mantissa) makes it the mantissa, whose unit under that exponent is 2^(-4p):
  the float is exactly 2^(23-4p) + code. Nibbles 0..4 are read this way from the word (bits
  16..19 still lie in the mantissa), nibbles 5..7 from the word shifted right by 16 once.
  (Equivalent to the 2^23-for-all variant with x pre-scaled by 16^-p, without the scaling.)
- The zero point rides on the subtraction that removes the magic number: subtracting the exact
  integer 2^(23-4p) + zero (< 2^24) leaves code - zero exactly. (Cheaper than folding it out
  as scale * (sum x*code - zero * sum x): no per-tile sum of x, no cancellation.)
- The scale is applied once per row and word: the eight (code - zero) * x of a word add up in
  an FFMA chain, times the group's scale into an fp32 accumulator [BLOCK_N, GT, WG] (one FFMA
  per eight weights; per channel, once at the end), reduced over K after the loop.

Everything before the products is exact, so the result differs from the fp32
dequantize-then-matmul reference (`gemm.linear_ref`) only in fp32 summation order.

A K tile is GT whole groups of WG words (BLOCK_K >= group) or a slice of one group (GT = 1),
kept 3-D as loaded (the weight tile is never reshaped); x comes as eight [GT, WG] tensors
x_j = x[8w + j] broadcast over the rows, converted once per thread for all the rows it holds
(`vec` caps the consecutive words a thread loads, which leaves it more rows; Triton moves x
between layouts through shared memory when its tile has as many elements as there are
threads). Triton pipelines the weight words (cp.async, NUM_STAGES); x, scales and zeros are
loaded one tile ahead by hand: waiting on them stalled every iteration (on an H100 the best
tiles got up to 1.8x faster with it, a few others slower: the tuner picks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.gemv_common import _out_rows, _silu_mul, _silu_out
from llmaccel.kernels.pdl import pdl_launch_dependents, pdl_wait

# The fp32 bit pattern of 2^23, passed as a run-time argument: as a compile-time constant,
# ptxas re-creates it (and its per-nibble variants) with a MOV before every use.
MAGIC_2_23 = 0x4B000000


@triton.jit
def _load_words(W, w_row, k0, K, EVEN_K: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr,
                VEC: tl.constexpr):
    """The words [BLOCK_N, GT, WG] of the tile at k0 (rows clamped by the caller: no mask)."""
    w = tl.max_contiguous(tl.arange(0, WG), VEC)  # at most VEC consecutive words per thread
    rw = k0 // 8 + tl.arange(0, GT)[:, None] * WG + w[None, :]
    if EVEN_K:
        word = tl.load(W + w_row[:, None, None] + rw[None, :, :])
    else:
        word = tl.load(W + w_row[:, None, None] + rw[None, :, :],
                       mask=(rw < K // 8)[None, :, :], other=0)
    return word


@triton.jit
def _ld(ptr, mask, EVEN_K: tl.constexpr):
    """A load that needs its mask only when K has a tail (or for a prefetch past the end)."""
    if EVEN_K:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0)
    return v


@triton.jit
def _x_at(X, NormW, kx, m, rstd, K, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
    """The GEMV's input at columns kx in fp32, after the fused prologue (rounded as the
    separate layers round, see gemm._input_tile): 0 x itself; 1 RMSNorm (round(x * rstd),
    times the norm weight, rounded); 2 SiLU-and-mul of X = [gate | up] (2K wide)."""
    dt = X.dtype.element_ty
    f = tl.float32
    if PROLOGUE == 2:
        v = _silu_mul(_ld(X + kx, m, EVEN_K).to(f), _ld(X + K + kx, m, EVEN_K).to(f),
                      dt).to(f)
    elif PROLOGUE == 1:
        x = _ld(X + kx, m, EVEN_K).to(f)
        nw = _ld(NormW + kx, m, EVEN_K).to(f)
        v = (nw * (x * rstd).to(dt).to(f)).to(dt).to(f)
    else:
        v = _ld(X + kx, m, EVEN_K).to(f)
    return v


@triton.jit
def _load_side(X, NormW, rstd, Scales, Zeros, s_row, z_row, k0, K, n_groups,
               GROUP: tl.constexpr, PER_CH: tl.constexpr, HAS_ZEROS: tl.constexpr,
               EVEN_K: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr,
               PROLOGUE: tl.constexpr):
    """The rest of the tile at k0: the input at k0 + 8w + j for j = 0..7 in fp32 ([GT, WG]
    each) and, grouped, the scales and zeros [BLOCK_N, GT] (per channel: dummies)."""
    g = tl.arange(0, GT)
    kx = k0 + 8 * (g[:, None] * WG + tl.arange(0, WG)[None, :])
    m = kx < K
    # carried to the next iteration in fp32
    x0 = _x_at(X, NormW, kx, m, rstd, K, PROLOGUE, EVEN_K)
    x1 = _x_at(X, NormW, kx + 1, m, rstd, K, PROLOGUE, EVEN_K)
    x2 = _x_at(X, NormW, kx + 2, m, rstd, K, PROLOGUE, EVEN_K)
    x3 = _x_at(X, NormW, kx + 3, m, rstd, K, PROLOGUE, EVEN_K)
    x4 = _x_at(X, NormW, kx + 4, m, rstd, K, PROLOGUE, EVEN_K)
    x5 = _x_at(X, NormW, kx + 5, m, rstd, K, PROLOGUE, EVEN_K)
    x6 = _x_at(X, NormW, kx + 6, m, rstd, K, PROLOGUE, EVEN_K)
    x7 = _x_at(X, NormW, kx + 7, m, rstd, K, PROLOGUE, EVEN_K)
    s = 0.0
    z = 0
    if not PER_CH:
        gi = k0 // GROUP + g
        s = _ld(Scales + s_row[:, None] + gi[None, :], (gi < n_groups)[None, :], EVEN_K)
        if HAS_ZEROS:
            z = _ld(Zeros + z_row[:, None] + gi[None, :], (gi < n_groups)[None, :], EVEN_K)
    return x0, x1, x2, x3, x4, x5, x6, x7, s, z


@triton.jit
def _next(k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Where to prefetch after the tile at k0: the next tile; after the last one the last
    again (unused, but in bounds without masks) or, with a K tail, past the end (masked)."""
    if EVEN_K:
        k1 = tl.minimum(k0 + BLOCK_K, K - BLOCK_K)
    else:
        k1 = k0 + BLOCK_K
    return k1


@triton.jit
def _nibble(part, src, p: tl.constexpr, zf, xj, magic):
    """part += x * (code - zero) for the nibble at bits 4p..4p+3 of `src`."""
    bits = (src & (0xF << (4 * p))) | (magic - ((4 * p) << 23))  # float 2^(23-4p) + code
    q = bits.to(tl.float32, bitcast=True) - (2.0 ** (23 - 4 * p) + zf)  # code - zero, exact
    return part + q * xj[None, :, :]


@triton.jit
def _accumulate(acc, word, x0, x1, x2, x3, x4, x5, x6, x7, s, z, magic,
                PER_CH: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """acc [BLOCK_N, GT, WG] += scale * sum over each word's 8 weights of x * (code - zero)."""
    zf = z.to(tl.float32)[:, :, None] if HAS_ZEROS else 8.0  # once per row and group
    hi = word >> 16  # nibbles 5..7; the arithmetic shift's sign bits are masked off
    part = _nibble(tl.zeros(acc.shape, tl.float32), word, 0, zf, x0, magic)
    part = _nibble(part, word, 1, zf, x1, magic)
    part = _nibble(part, word, 2, zf, x2, magic)
    part = _nibble(part, word, 3, zf, x3, magic)
    part = _nibble(part, word, 4, zf, x4, magic)
    part = _nibble(part, hi, 1, zf, x5, magic)
    part = _nibble(part, hi, 2, zf, x6, magic)
    part = _nibble(part, hi, 3, zf, x7, magic)
    if PER_CH:
        acc += part  # one scale for the whole row: applied after the loop
    else:
        acc += part * s.to(tl.float32)[:, :, None]
    return acc


@triton.jit
def _gemv_w4_kernel(
    X, W, Scales, Zeros, Bias, Y, NormW,
    N, K, n_groups, stride_wn, stride_sn, stride_zn, magic, eps,
    GROUP: tl.constexpr, PER_CH: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, PROLOGUE: tl.constexpr,
    RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, SILU_OUT: tl.constexpr,
):
    WG: tl.constexpr = (BLOCK_K if PER_CH or BLOCK_K <= GROUP else GROUP) // 8
    GT: tl.constexpr = BLOCK_K // (8 * WG)
    # Rows past N re-read a valid row (their results are not stored): no mask on weight
    # loads. SILU_OUT interleaves gate and up rows (gemv_common._out_rows).
    rows = _out_rows(N, BLOCK_N, SILU_OUT)
    w_row, s_row, z_row = rows * stride_wn, rows * stride_sn, rows * stride_zn
    acc = tl.zeros((BLOCK_N, GT, WG), tl.float32)
    if USE_PDL:
        # Weights are read-only during a step: start streaming the first tile while the
        # previous kernel (which produces X) finishes.
        word0 = _load_words(W, w_row, 0, K, EVEN_K, GT, WG, VEC)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    rstd = 0.0
    if PROLOGUE == 1:
        # RMSNorm needs the whole row's mean square before the first tile: a pass over x (a
        # hidden-size vector the previous kernel just wrote, so read from L2) in as few loads
        # as possible, since each one is a round trip on the critical path after the wait.
        sq = tl.zeros((BLOCK_R,), tl.float32)
        for k0 in range(0, K, BLOCK_R):
            rk = k0 + tl.arange(0, BLOCK_R)
            xs = tl.load(X + rk, mask=rk < K, other=0.0).to(tl.float32)
            sq += xs * xs
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    z_ch = tl.load(Zeros + z_row)[:, None] if PER_CH and HAS_ZEROS else 0
    x0, x1, x2, x3, x4, x5, x6, x7, s, z = _load_side(
        X, NormW, rstd, Scales, Zeros, s_row, z_row, 0, K, n_groups, GROUP, PER_CH, HAS_ZEROS,
        EVEN_K, GT, WG, PROLOGUE)
    k_start = 0
    if USE_PDL:
        k_start = BLOCK_K
        y0, y1, y2, y3, y4, y5, y6, y7, s1, z1 = _load_side(
            X, NormW, rstd, Scales, Zeros, s_row, z_row, _next(0, K, BLOCK_K, EVEN_K), K,
            n_groups, GROUP, PER_CH, HAS_ZEROS, EVEN_K, GT, WG, PROLOGUE)
        acc = _accumulate(acc, word0, x0, x1, x2, x3, x4, x5, x6, x7,
                          s, z_ch if PER_CH else z, magic, PER_CH, HAS_ZEROS)
        x0, x1, x2, x3, x4, x5, x6, x7, s, z = y0, y1, y2, y3, y4, y5, y6, y7, s1, z1
    for k0 in tl.range(k_start, K, BLOCK_K, num_stages=NUM_STAGES):
        word = _load_words(W, w_row, k0, K, EVEN_K, GT, WG, VEC)
        y0, y1, y2, y3, y4, y5, y6, y7, s1, z1 = _load_side(
            X, NormW, rstd, Scales, Zeros, s_row, z_row, _next(k0, K, BLOCK_K, EVEN_K), K,
            n_groups, GROUP, PER_CH, HAS_ZEROS, EVEN_K, GT, WG, PROLOGUE)
        acc = _accumulate(acc, word, x0, x1, x2, x3, x4, x5, x6, x7,
                          s, z_ch if PER_CH else z, magic, PER_CH, HAS_ZEROS)
        x0, x1, x2, x3, x4, x5, x6, x7, s, z = y0, y1, y2, y3, y4, y5, y6, y7, s1, z1
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if PER_CH:
        y = y * tl.load(Scales + s_row).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(Bias + rows).to(tl.float32)
    if SILU_OUT:  # the layer's output rounded as it would be stored, then silu_and_mul
        _silu_out(y.to(Y.dtype.element_ty), Y, N, BLOCK_N)
    else:
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if RESIDUAL:
            # Y holds the residual stream: Y += product, rounded as the unfused layers round
            # (the product to the activation dtype, then the sum), as gemm.py's epilogue does.
            res = tl.load(Y + rn, mask=rn < N, other=0.0).to(tl.float32)
            y = y.to(Y.dtype.element_ty).to(tl.float32) + res
        tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=rn < N)


@dataclass(frozen=True)
class GemvW4Config:
    block_n: int
    block_k: int
    num_warps: int = 2
    num_stages: int = 3
    vec: int = 2  # at most this many consecutive words a thread loads (powers of two)

    def describe(self) -> str:
        return f"n{self.block_n}k{self.block_k}v{self.vec}-w{self.num_warps}s{self.num_stages}"


def default_gemv_w4_config(n: int, k: int, group: int) -> GemvW4Config:
    """The untuned tile: 16 rows by 512 columns (4 groups of 128) on 2 warps; in an H100 sweep
    the fastest on 4 of the 8 llama-3.2-1b/3b shapes and within about 12% on the others."""
    group = k if group == -1 else group
    block_k = 512
    while block_k > 8 and (block_k // 2 >= k or not _valid_block_k(block_k, k, group)):
        block_k //= 2
    return GemvW4Config(block_n=16, block_k=block_k, num_warps=2, num_stages=3, vec=2)


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def _valid_block_k(block_k: int, k: int, group: int) -> bool:
    """A power of two >= 8 that lies in one group (dividing it) or covers whole groups of a
    power-of-two size; per channel (group == k) anything."""
    if not _pow2(block_k) or block_k < 8:
        return False
    if group == k:
        return True
    return group % block_k == 0 if block_k <= group else (block_k % group == 0
                                                           and _pow2(group))


def check_side_tensors(n: int, k: int, group: int, scales: torch.Tensor,
                       zeros: torch.Tensor | None, bias: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Contiguous scales [N, K // group] and uint8 zeros (or None) of an int4 GEMV call, and a
    bias of [N]; ValueError naming what is off. Shared with `gemv_w4_cuda`."""
    scales = scales.contiguous()
    if scales.shape != (n, k // group):
        raise ValueError(f"scales {tuple(scales.shape)} must be [N, K // group] = "
                         f"{(n, k // group)}")
    if zeros is not None:
        zeros = zeros.contiguous()
        if zeros.shape != scales.shape or zeros.dtype != torch.uint8:
            raise ValueError("zeros must be uint8 with the shape of scales")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]")
    return scales, zeros


def gemv_output(x: torch.Tensor, n: int, residual: torch.Tensor | None,
                silu_out: bool) -> torch.Tensor:
    """Where a batch-1 GEMV writes: the residual stream (checked) or a new [..., N] tensor
    ([..., N / 2] with the SiLU epilogue). Shared with `gemv_w4_cuda`."""
    if residual is None:
        return torch.empty(*x.shape[:-1], n // 2 if silu_out else n, dtype=x.dtype,
                           device=x.device)
    if (residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype
            or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous {(*x.shape[:-1], n)} tensor in "
                         f"{x.dtype}")
    return residual


def w4a16_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
               config: GemvW4Config | None = None, *, norm_weight: torch.Tensor | None = None,
               eps: float = 0.0, silu: bool = False,
               residual: torch.Tensor | None = None, silu_out: bool = False) -> torch.Tensor:
    """x [..., K] holding exactly one row -> y [..., N] in x's dtype. `weight` int32 [N, K/8],
    `scales` [N, G], `zeros` uint8 [N, G] or None (zero point 8), group_size -1 per channel.

    The fused decode variants of `gemm.triton_linear`, rounded the same way: `norm_weight`
    (the input is RMSNorm(x) * norm_weight with `eps`), `silu` (x is [gate | up], 2K wide; the
    input is silu(gate) * up), `residual` [..., N] (updated in place to residual + product and
    returned); `silu_out` (a [gate; up] layer, N = 2I) returns silu_and_mul of the product,
    [..., I], the activation computed in the epilogue."""
    if silu and norm_weight is not None:
        raise ValueError("one prologue at a time: silu or norm_weight")
    if silu_out and (silu or residual is not None or weight.shape[0] % 2):
        raise ValueError("silu_out needs an even N ([gate; up] rows), no silu prologue and no "
                         "residual")
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    if x.numel() != x.shape[-1] or k == 0:
        raise ValueError(f"w4a16_gemv takes exactly one row of x, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    n = weight.shape[0]
    if (weight.dtype != torch.int32 or weight.dim() != 2 or k % 8
            or weight.shape[1] != k // 8 or weight.stride(-1) != 1):
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} is not int32 [N, K/8] "
                         f"for K={k}")
    group = k if group_size == -1 else group_size
    if group <= 0 or group % 8 or k % group:
        raise ValueError(f"group_size {group_size} must be -1 or a multiple of 8 dividing K={k}")
    scales, zeros = check_side_tensors(n, k, group, scales, zeros, bias)
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [{k}]")
    cfg = config or default_gemv_w4_config(n, k, group)
    if not (_pow2(cfg.block_n) and _pow2(cfg.vec) and _valid_block_k(cfg.block_k, k, group)
            and (cfg.block_n >= 2 or not silu_out)):
        raise ValueError(f"config {cfg.describe()} does not fit K={k}, group {group}: "
                         "powers of two, block_k within one group or whole groups")
    y = gemv_output(x, n, residual, silu_out)
    if n == 0:
        return y
    x1 = x.reshape(x.shape[-1]).contiguous()
    dummy = weight  # pointer arguments the constexpr flags switch off
    grid = triton.cdiv(n // 2, cfg.block_n // 2) if silu_out else triton.cdiv(n, cfg.block_n)
    _gemv_w4_kernel[(grid,)](
        x1, weight, scales, zeros if zeros is not None else dummy,
        bias if bias is not None else dummy, y,
        norm_weight if norm_weight is not None else dummy,
        n, k, k // group, weight.stride(0), scales.stride(0),
        0 if zeros is None else zeros.stride(0), MAGIC_2_23, eps,
        # per channel: one compile for every K (GROUP unused)
        GROUP=0 if group == k else group, PER_CH=group == k, HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, VEC=cfg.vec, NUM_STAGES=cfg.num_stages, USE_PDL=pdl.enabled(),
        PROLOGUE=1 if norm_weight is not None else (2 if silu else 0),
        RESIDUAL=residual is not None, SILU_OUT=silu_out,
        # the RMSNorm pass loads the row in one go (up to 8192 columns)
        BLOCK_R=min(8192, triton.next_power_of_2(k)) if norm_weight is not None else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(),
    )
    return y
