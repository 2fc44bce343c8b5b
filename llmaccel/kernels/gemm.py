"""Triton linear layers for decode and prefill: dense (bf16/fp16), W8A16 and W4A16.

One kernel, `y = x @ dequant(W)^T (+ b)`, with the weight format a compile-time constant:

    BITS=16  W [N, K] in the activation dtype (a plain linear; used for decode GEMVs, where
             cuBLAS is measured slower than streaming the weight once at full bandwidth)
    BITS=8   W uint8 [N, K], one code per weight
    BITS=4   W int32 [N, K/8], word j of row n holds codes k = 8j..8j+7, lowest nibble first

and for BITS 8/4 per-group `scales` [N, G] and integer `zeros` [N, G] (uint8), so
w[n, k] = (code - zero[n, k // group]) * scale[n, k // group], exactly the dequantization of
`llmaccel.models.layers.linear_methods.dequantize_unpacked`. Symmetric weights skip the zero tensor
(ZERO is the constant 2^(bits-1)). Act-order checkpoints permute the input channels once at
load (`prepare_packed_weight`), so groups are contiguous and x is permuted per call.

Each program owns BLOCK_M rows of x and BLOCK_N output channels and streams its weight rows
over K once; the dequantized tile feeds `tl.dot` (BLOCK_M >= 16) or a broadcast
multiply-and-sum (small BLOCK_M, no tensor-core layout shuffle). Decode (M <= 16) is
bandwidth-bound, so configs aim for enough bytes in flight per SM; prefill (large M) reuses
each dequantized tile across BLOCK_M rows. `pick_config` chooses per shape.
Reference: `linear_ref` (dequantize in fp32 + F.linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.pdl import pdl_launch_dependents, pdl_wait


@triton.jit
def _weight_tile(W, Scales, Zeros, rn64, mask_n, k0, K, stride_wn, stride_sn, stride_zn,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at k0: the stored values (BITS 16) or the
    dequantized codes in fp32."""
    rk = k0 + tl.arange(0, BLOCK_K)
    mask_k = rk < K
    wmask = mask_n[:, None] & mask_k[None, :]
    if BITS == 16:
        w = tl.load(W + rn64[:, None] * stride_wn + rk[None, :], mask=wmask, other=0.0)
    else:
        if BITS == 8:
            q = tl.load(W + rn64[:, None] * stride_wn + rk[None, :], mask=wmask, other=0)
            q = q.to(tl.int32)
        else:
            # Load each int32 word once ([BLOCK_N, BLOCK_K/8], contiguous along K), split
            # it into its eight nibbles on a new last axis and flatten: k = 8 * word + i.
            rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            word = tl.load(W + rn64[:, None] * stride_wn + rw[None, :],
                           mask=mask_n[:, None] & (rw < K // 8)[None, :], other=0)
            shifts = tl.arange(0, 8) * 4
            q = (word[:, :, None] >> shifts[None, None, :]) & 0xF
            q = tl.reshape(q, (BLOCK_N, BLOCK_K))
        # Codes to exact fp32 integers without the slow int-to-float instruction: OR them
        # into the mantissa of 2^23 and subtract 2^23 + zero in one step (exact: < 2^24).
        qf = (q | 0x4B000000).to(tl.float32, bitcast=True)
        if BLOCK_K <= GROUP:
            # the whole tile lies in one group (GROUP is a multiple of BLOCK_K)
            g = k0 // GROUP
            s = tl.load(Scales + rn64 * stride_sn + g, mask=mask_n, other=0.0)
            if HAS_ZEROS:
                z = tl.load(Zeros + rn64 * stride_zn + g, mask=mask_n, other=0)
                z = z.to(tl.float32) + 8388608.0
            else:
                z = tl.full((BLOCK_N,), 8388608.0 + (1 << (BITS - 1)), tl.float32)
            w = (qf - z[:, None]) * s.to(tl.float32)[:, None]
        else:
            # The tile spans BLOCK_K // GROUP groups: one scale (and zero) per row and
            # group, broadcast over the group's codes.
            gi = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            smask = mask_n[:, None] & (gi * GROUP < K)[None, :]
            s = tl.load(Scales + rn64[:, None] * stride_sn + gi[None, :], mask=smask,
                        other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(Zeros + rn64[:, None] * stride_zn + gi[None, :], mask=smask,
                            other=0).to(tl.float32) + 8388608.0
            else:
                z = tl.full((BLOCK_N, BLOCK_K // GROUP), 8388608.0 + (1 << (BITS - 1)),
                            tl.float32)
            qf3 = tl.reshape(qf, (BLOCK_N, BLOCK_K // GROUP, GROUP))
            w = tl.reshape((qf3 - z[:, :, None]) * s[:, :, None], (BLOCK_N, BLOCK_K))
        # (the broadcast product takes w in fp32: no rounding to the activation dtype and
        # back, a little more exact than the dequantize-then-matmul reference)
    return w


@triton.jit
def _input_tile(X, NormW, rm64, mask_m, k0, K, stride_xm, rstd,
                PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] input tile at k0, after the fused prologue:
    0 none; 1 RMSNorm (x * rstd rounded, times the norm weight, rounded: RMSNorm's steps);
    2 SiLU-and-mul (X rows hold [gate | up], 2K wide: silu(gate) rounded, times up, rounded)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    mask = mask_m[:, None] & (rk < K)[None, :]
    ptr = X + rm64[:, None] * stride_xm + rk[None, :]
    dt = X.dtype.element_ty
    if PROLOGUE == 2:
        gate = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptr + K, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        x = (act * up).to(dt)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
        if PROLOGUE == 1:
            nw = tl.load(NormW + rk, mask=rk < K, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)
            x = (nw[None, :] * normed).to(dt)
    return x


@triton.jit
def _tile_product(acc, x, w, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    if USE_DOT:
        if IEEE:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    else:
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, axis=2)
    return acc


@triton.jit
def _linear_kernel(
    X, W, Scales, Zeros, Bias, Y, NormW,
    M, N, K, eps,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr,
    PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_PDL:
        # Weights are read-only during a step: start streaming the first tile while the
        # previous kernel (which produces X) finishes.
        w_first = _weight_tile(W, Scales, Zeros, rn64, mask_n, 0, K, stride_wn, stride_sn,
                               stride_zn, BITS, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        # RMSNorm of whole rows before the first tile: one pass over each row of X (it is a
        # hidden-size vector per row, read from L2 by every program).
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(X + rm64[:, None] * stride_xm + rk[None, :],
                         mask=mask_m[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
        rstd = tl.rsqrt(sq / K + eps)
    k_start = 0
    if USE_PDL:
        x = _input_tile(X, NormW, rm64, mask_m, 0, K, stride_xm, rstd, PROLOGUE, BLOCK_K)
        acc = _tile_product(acc, x, w_first, USE_DOT, IEEE)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _weight_tile(W, Scales, Zeros, rn64, mask_n, k0, K, stride_wn, stride_sn,
                         stride_zn, BITS, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
        x = _input_tile(X, NormW, rm64, mask_m, k0, K, stride_xm, rstd, PROLOGUE, BLOCK_K)
        acc = _tile_product(acc, x, w, USE_DOT, IEEE)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptr = Y + rm64[:, None] * stride_ym + rn[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if RESIDUAL:
        # Y holds the residual stream: Y += x @ W^T, rounded as the unfused layers round
        # (the product to the activation dtype, then the sum).
        res = tl.load(out_ptr, mask=out_mask, other=0.0).to(tl.float32)
        out = acc.to(Y.dtype.element_ty).to(tl.float32) + res
        tl.store(out_ptr, out.to(Y.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr, acc.to(Y.dtype.element_ty), mask=out_mask)


PER_CHANNEL_GROUP = 1 << 30


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3

    def describe(self) -> str:
        mode = "dot" if self.use_dot else "fma"
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}-{mode}"
                f"-w{self.num_warps}s{self.num_stages}")


def pick_config(m: int, n: int, k: int, bits: int, group: int) -> GemmConfig:
    """Tile sizes per shape. Decode rows (m <= 16) stream the weight: narrow BLOCK_N keeps
    enough programs for every SM even on 2048-wide outputs, wide BLOCK_K keeps bytes in
    flight. Larger m reuses each dequantized tile across a 64-row block with tensor cores."""
    block_k = 128 if bits == 16 else max(16, min(128, _pow2_floor(group)))
    if m <= 2 and bits == 8:
        # W8A16 decode: 4 rows by up to 1024 columns, the H100 table's tile for 6 of the 8
        # llama-3.2 shapes at m = 1; the 16 x 128 tile below ran an untuned H200's batch-1
        # int8 decode at 0.32x bf16
        return GemmConfig(block_m=max(1, triton.next_power_of_2(m)), block_n=4,
                          block_k=max(16, min(1024, _pow2_floor(group))), use_dot=False,
                          num_warps=4, num_stages=4)
    if m <= 2:
        return GemmConfig(block_m=max(1, triton.next_power_of_2(m)), block_n=16,
                          block_k=min(256, block_k * 2) if bits == 16 else block_k,
                          use_dot=False, num_warps=4, num_stages=4)
    if m <= 16:
        return GemmConfig(block_m=16, block_n=32, block_k=block_k, use_dot=True,
                          num_warps=4, num_stages=4)
    return GemmConfig(block_m=64, block_n=64, block_k=min(64, block_k), use_dot=True,
                      num_warps=4, num_stages=3)


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bits: int = 16,
                  scales: torch.Tensor | None = None, zeros: torch.Tensor | None = None,
                  group_size: int = -1, bias: torch.Tensor | None = None,
                  config: GemmConfig | None = None, *, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0, silu: bool = False,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]. `weight` in the BITS layout of the module docstring; `scales`
    [N, G] and optional `zeros` [N, G] for bits 8/4; group_size -1 means one group per row.

    Fused decode variants (the layer's neighbours folded into the product, saving launches):
    - `norm_weight`: the input is RMSNorm(x) * norm_weight with `eps` (x is the residual stream);
    - `silu`: x is [..., 2K] = [gate | up] and the input is silu(gate) * up;
    - `residual` [..., N]: returns `residual` updated in place to residual + product.
    Each rounds as the separate layers do (`fused_linear_ref`)."""
    if bits not in (4, 8, 16):
        raise ValueError(f"bits must be 4, 8 or 16, got {bits}")
    if silu and norm_weight is not None:
        raise ValueError("one prologue at a time: silu or norm_weight")
    lead = x.shape[:-1]
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n = weight.shape[0]
    expected_cols = {16: k, 8: k, 4: k // 8}[bits]
    if weight.shape[1] != expected_cols or weight.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit K={k} at {bits} bits")
    group = k if group_size == -1 else group_size
    if bits != 16:
        if scales is None or k % group or scales.shape != (n, k // group):
            raise ValueError("scales must be [N, K // group_size]")
        if zeros is not None and zeros.shape != scales.shape:
            raise ValueError("zeros must have the shape of scales")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [{k}]")
    if residual is not None:
        if residual.shape != (*lead, n) or residual.dtype != x.dtype:
            raise ValueError(f"residual must be {(*lead, n)} in {x.dtype}")
        y = residual.view(-1, n)
        if y.stride(-1) != 1:
            raise ValueError("residual must have a contiguous last dim")
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    cfg = config or pick_config(m, n, k, bits, group)
    # One scale column (per channel) compiles once for every K: a group larger than any K.
    group_const = PER_CHANNEL_GROUP if bits == 16 or group == k else group
    dummy = weight  # pointer arguments the constexpr flags switch off
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _linear_kernel[grid](
        x2, weight,
        scales if scales is not None else dummy,
        zeros if zeros is not None else dummy,
        bias if bias is not None else dummy, y,
        norm_weight if norm_weight is not None else dummy,
        m, n, k, eps,
        x2.stride(0), weight.stride(0),
        scales.stride(0) if scales is not None else 0,
        zeros.stride(0) if zeros is not None else 0,
        y.stride(0),
        BITS=bits, GROUP=group_const, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot, IEEE=x.dtype == torch.float32,
        PROLOGUE=1 if norm_weight is not None else (2 if silu else 0),
        RESIDUAL=residual is not None, USE_PDL=pdl.enabled(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(),
    )
    return y.reshape(*lead, n)


@triton.jit
def _dequant_kernel(W, Scales, Zeros, Out, N, K, stride_wn, stride_sn, stride_zn, stride_on,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rn64 = rn.to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    w = _weight_tile(W, Scales, Zeros, rn64, mask_n, k0, K, stride_wn, stride_sn, stride_zn,
                     BITS, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(Out + rn64[:, None] * stride_on + rk[None, :], w.to(Out.dtype.element_ty),
             mask=mask_n[:, None] & (rk < K)[None, :])


def dequantize_packed(weight: torch.Tensor, bits: int, scales: torch.Tensor,
                      zeros: torch.Tensor | None, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` from the BITS 4/8 layout of the module docstring: (code - zero) *
    scale in fp32, rounded once to `dtype`, which is the weight `linear_ref` multiplies by. One
    memory-bound Triton kernel; for prefill-sized batches, where this plus a cuBLAS GEMM beats
    the fused W4A16 GEMM (`models/layers/linear_methods.py`)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n = weight.shape[0]
    k = weight.shape[1] * (8 if bits == 4 else 1)
    group = k if group_size == -1 else group_size
    if scales.shape != (n, k // group) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError("scales (and zeros) must be [N, K // group_size]")
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if n == 0 or k == 0:
        return out
    block_k = max(16, min(128, _pow2_floor(group)))
    block_n = 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](
        weight, scales, zeros if zeros is not None else scales, out, n, k, weight.stride(0),
        scales.stride(0), zeros.stride(0) if zeros is not None else 0, out.stride(0),
        BITS=bits, GROUP=PER_CHANNEL_GROUP if group == k else group,
        HAS_ZEROS=zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def fused_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     silu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of the fused variants of `triton_linear` on a dense weight: the
    separate layers' ops in order (RMSNorm / SiLU-and-mul, F.linear, residual add in place)."""
    from llmaccel.kernels.activation import silu_and_mul_ref
    from llmaccel.kernels.rmsnorm import rms_norm_ref

    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    if silu:
        x = silu_and_mul_ref(x)
    # The product accumulates in fp32 and is rounded once, as cuBLAS does on the GPU (CPU
    # bf16 matmuls round differently).
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if residual is None:
        return y
    residual.copy_(y + residual)
    return residual


# --------------------------------------------------------------------------- weight layout

@dataclass
class PackedWeight:
    """A quantized linear weight in the kernel's layout (module docstring)."""

    weight: torch.Tensor                 # uint8 [N, K] (8 bits) or int32 [N, K/8] (4 bits)
    scales: torch.Tensor                 # [N, G] activation dtype when exact, else fp32
    zeros: torch.Tensor | None           # uint8 [N, G]; None when every zero is 2^(bits-1)
    bits: int
    group_size: int                      # -1: per channel
    perm: torch.Tensor | None = None     # act-order: x[:, perm] before the kernel


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (K % 8 == 0) -> int32 [N, K/8], lowest nibble = lowest k."""
    n, k = codes.shape
    c = codes.to(torch.int64).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    words = (c << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def prepare_packed_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          g_idx: torch.Tensor, bits: int, act_dtype: torch.dtype
                          ) -> PackedWeight | None:
    """The kernel layout from the unpacked one (codes uint8 [N, K], fp32 scales [N, G], int
    zeros [N, G], g_idx [K]), or None when the kernel cannot take it (odd K, or groups that
    are not equal contiguous runs even after sorting the input channels)."""
    n, k = codes.shape
    n_groups = scales.shape[1]
    if bits not in (4, 8) or k % n_groups or (bits == 4 and k % 8):
        return None
    group = k // n_groups
    perm = None
    expected = torch.arange(k, device=g_idx.device) // group
    if not torch.equal(g_idx.to(torch.int64), expected):
        # act order: sort the input channels by group; then each group must be one run
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        if not torch.equal(g_idx.to(torch.int64)[perm], expected):
            return None
        codes = codes[:, perm]
    scales_act = scales.to(act_dtype)
    if torch.equal(scales_act.to(torch.float32), scales.to(torch.float32)):
        scales = scales_act  # fp16/bf16 checkpoints: half the scale bytes, still exact
    else:
        scales = scales.to(torch.float32)
    zero_const = 1 << (bits - 1)
    z = None if bool((zeros == zero_const).all()) else zeros.to(torch.uint8)
    if z is not None and not torch.equal(z.to(zeros.dtype), zeros):
        return None  # zero points outside 0..255 cannot come from 4/8-bit codes
    w = codes.to(torch.uint8).contiguous() if bits == 8 else pack_int4_rows(codes)
    return PackedWeight(weight=w.contiguous(), scales=scales.contiguous(),
                        zeros=None if z is None else z.contiguous(), bits=bits,
                        group_size=-1 if n_groups == 1 else group, perm=perm)


def packed_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                  config: GemmConfig | None = None) -> torch.Tensor:
    if pw.perm is not None:
        x = x.index_select(-1, pw.perm)
    return triton_linear(x, pw.weight, pw.bits, pw.scales, pw.zeros, pw.group_size, bias,
                         config)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bits: int = 16,
               scales: torch.Tensor | None = None, zeros: torch.Tensor | None = None,
               group_size: int = -1, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of `triton_linear` (fp32 dequantize, product in x's dtype)."""
    if bits == 16:
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    if bits == 8:
        q = weight.to(torch.int32)
    else:
        shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int32)
        q = ((weight.to(torch.int32)[:, :, None] >> shifts) & 0xF).reshape(weight.shape[0], k)
    group = k if group_size == -1 else group_size
    g = torch.arange(k, device=weight.device) // group
    z = (1 << (bits - 1)) if zeros is None else zeros.to(torch.int32)[:, g]
    w = (q - z).to(torch.float32) * scales.to(torch.float32)[:, g]
    return F.linear(x, w.to(x.dtype), bias)
