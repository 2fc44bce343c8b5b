"""Batch-1 W4A16 GEMV in CUDA C (`csrc/gemv_w4.cu`, compiled by NVRTC through `cuda_rtc`).

Same function, layout and rounding as the Triton GEMV (`gemv_w4.w4a16_gemv`, plain variant:
no fused prologue or epilogue): x [..., K] holding one row, weight int32 [N, K/8], scales
[N, G] (bf16, fp16 or fp32), uint8 zeros [N, G] or None (zero point 8), optional bias.
Differs in shape of work: each thread issues all of its weight loads at once, before the
programmatic-dependent-launch wait (see the .cu file), which Triton's tiles could not do
without losing speed.

`supports` says whether a call can take this kernel (CUDA C kernels available, bf16/fp16
activations, K and the group a multiple of 32, 16-byte aligned rows); callers fall back to
Triton otherwise. The reference is `gemm.linear_ref`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass

import torch

from llmaccel.kernels import cuda_rtc, l2_prefetch, pdl
from llmaccel.kernels.gemv_w4 import MAGIC_2_23, check_side_tensors, gemv_output

MAX_THREADS = 1024
MAX_REGS_PRODUCT = 16  # rows x chunks: 4 registers each for the codes, more spills


@dataclass(frozen=True)
class CudaGemvW4Config:
    rows: int  # output rows per block
    chunks: int = 1  # 32-code chunks of a row per thread
    math: int = 1  # 0: magic-number dequantization; 1: codes as subnormal floats (the .cu)
    # blocks an SM must hold at once (the .cu's MIN_BLOCKS: ptxas budgets registers for it);
    # 0: no bound
    min_blocks: int = 0

    def describe(self) -> str:
        return (f"cuda-r{self.rows}c{self.chunks}" + ("s" if self.math else "")
                + (f"b{self.min_blocks}" if self.min_blocks else ""))

    def threads(self, k: int) -> int:
        per_thread = -(-(k // 32) // self.chunks)
        return max(32, -(-per_thread // 32) * 32)

    def fits(self, k: int) -> bool:
        """The block needs at most 1024 threads, and the codes fit the register budget."""
        return (self.rows >= 1 and self.chunks >= 1 and self.math in (0, 1)
                and self.threads(k) <= MAX_THREADS and self.rows * self.chunks <= MAX_REGS_PRODUCT
                and 0 <= self.min_blocks <= 32)


def default_config(n: int, k: int) -> CudaGemvW4Config:
    """The untuned tile, from an H100 sweep on the llama-3.2-3b shapes: codes as subnormals (MATH 1, as fast or faster on every
    shape), 2 rows per block for the smallest matrices (o, 9.4M weights), 4 above (qkv,
    gate_up, down, the LM head); one chunk per thread, more only where K needs over 1024
    threads."""
    chunks = 1
    while CudaGemvW4Config(2, chunks).threads(k) > MAX_THREADS:
        chunks *= 2
    return CudaGemvW4Config(2 if n * k < 12_000_000 else 4, chunks, 1)


def tile_for(n: int, k: int, device: torch.device | None = None) -> tuple[CudaGemvW4Config, bool]:
    """(the tile for an N x K layer, whether it is tuned): the GPU table's "w4cuda:1:N:K"
    entry (benchmarks/bench_w4_cuda_gemv.py --out-table), else `default_config`."""
    from llmaccel.kernels.gemm_tuning import gemv_w4_cuda_config

    tuned = gemv_w4_cuda_config(n, k, device)
    return (tuned, True) if tuned is not None else (default_config(n, k), False)


@functools.lru_cache(maxsize=1)
def _source() -> tuple[str, dict[str, str]]:
    """The kernel's source and the header it includes."""
    return cuda_rtc.source_files("gemv_w4.cu", "common.cuh")


# common.cuh's SCALE_KIND of each scale dtype (the int4 GEMV and GEMM)
SCALE_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def supports(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
             silu: bool = False) -> bool:
    """Whether `w4a16_gemv_cuda` takes this call (else use the Triton GEMV). With `silu`, x
    is [gate | up], twice the weight's K."""
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    group = k if group_size == -1 else group_size
    return (x.is_cuda and x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16)
            and k > 0 and k % 32 == 0 and group % 32 == 0 and k % group == 0
            and weight.dtype == torch.int32 and weight.dim() == 2 and weight.shape[1] == k // 8
            and weight.stride(1) == 1 and weight.stride(0) % 4 == 0
            and weight.data_ptr() % 16 == 0 and scales.dtype in SCALE_KINDS
            and (bias is None or bias.dtype == x.dtype)
            and cuda_rtc.available(x.device))


@dataclass(frozen=True)
class RopeCache:
    """The qkv GEMV's ROPE epilogue (the .cu file): rotary embedding of q and k for one decode
    token and the write of rotated k and of v into the paged cache, as
    `rotary.rotary_and_cache` does after a plain GEMV. The layer's rows are [q; k; v] heads."""
    positions: torch.Tensor  # [1] int64, the token's position
    cos_sin_cache: torch.Tensor  # [max_pos, head_dim] fp32 = cat(cos, sin)
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim], x's dtype
    slot_mapping: torch.Tensor  # [1] int64, the token's cache slot (-1: write nothing)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def check(self, x: torch.Tensor, n: int) -> None:
        """A ValueError naming what this epilogue cannot take."""
        hd, nkv = self.head_dim, self.num_kv_heads
        problems = []
        if hd % 2 or n != (self.num_q_heads + 2 * nkv) * hd:
            problems.append(f"N={n} is not (q heads + 2 kv heads) x an even head_dim")
        for name in ("positions", "slot_mapping"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.numel() != 1 or t.device != x.device:
                problems.append(f"{name} must be one int64 on {x.device}")
        cs = self.cos_sin_cache
        if cs.dtype != torch.float32 or cs.dim() != 2 or cs.shape[1] != hd or cs.stride(1) != 1:
            problems.append(f"cos_sin_cache must be fp32 [max_pos, {hd}]")
        kv = self.kv_cache
        if (kv.dtype != x.dtype or kv.dim() != 5 or kv.shape[0] != 2
                or tuple(kv.shape[-2:]) != (nkv, hd) or kv.stride(-1) != 1
                or kv.device != x.device):
            problems.append(f"kv_cache must be [2, blocks, block_size, {nkv}, {hd}] in {x.dtype}")
        if problems:
            raise ValueError("rope epilogue: " + "; ".join(problems))

    def args(self) -> list:
        """The kernel's trailing arguments."""
        ptr, kv = ctypes.c_void_p, self.kv_cache
        return [ptr(self.positions.data_ptr()), ptr(self.cos_sin_cache.data_ptr()),
                ctypes.c_longlong(self.cos_sin_cache.stride(0)),
                ptr(self.slot_mapping.data_ptr()), ptr(kv[0].data_ptr()), ptr(kv[1].data_ptr()),
                ctypes.c_longlong(kv.stride(1)), ctypes.c_longlong(kv.stride(2)),
                ctypes.c_longlong(kv.stride(3)), ctypes.c_int(kv.shape[2]),
                ctypes.c_int(self.num_q_heads), ctypes.c_int(self.num_kv_heads)]


_NO_ROPE = [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_longlong(0), ctypes.c_void_p(0),
            ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_longlong(0), ctypes.c_longlong(0),
            ctypes.c_longlong(0), ctypes.c_int(1), ctypes.c_int(0), ctypes.c_int(0)]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 16-byte-aligned copy where `t` is not one (the kernel loads 16 bytes)."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous().clone()


def w4a16_gemv_cuda(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None, group_size: int,
                    bias: torch.Tensor | None = None, config: CudaGemvW4Config | None = None,
                    *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    silu: bool = False, residual: torch.Tensor | None = None,
                    silu_out: bool = False, rope: RopeCache | None = None,
                    prefetch: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """y [..., N] = x @ dequant(weight)^T (+ bias), in x's dtype (see the module docstring).

    The fused decode variants of `gemv_w4.w4a16_gemv`, rounded the same way: `norm_weight`
    (the input is RMSNorm(x) * norm_weight with `eps`), `silu` (x is [gate | up], 2K wide; the
    input is silu(gate) * up), `residual` [..., N] (updated in place to residual + product and
    returned); `silu_out` (a [gate; up] layer, N = 2I) returns silu_and_mul of the product,
    [..., I], the activation computed in the epilogue (the tile's rows must be even).
    `rope` (a qkv layer of one decode token) returns q [..., num_q_heads * head_dim] rotated
    and writes rotated k and v to the paged cache (see `RopeCache`). `prefetch`: ranges of a
    later kernel's weights for the blocks to prefetch into L2 (`kernels/l2_prefetch.py`)."""
    if silu and norm_weight is not None:
        raise ValueError("one prologue at a time: silu or norm_weight")
    if rope is not None and (silu or norm_weight is not None or residual is not None
                             or silu_out):
        raise ValueError("the rope epilogue takes no prologue, residual or silu_out")
    if silu_out and (silu or residual is not None or weight.shape[0] % 2):
        raise ValueError("silu_out needs an even N ([gate; up] rows), no silu prologue and no "
                         "residual")
    if not supports(x, weight, scales, zeros, group_size, bias, silu):
        raise ValueError(f"w4a16_gemv_cuda cannot take x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, group {group_size}")
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    n = weight.shape[0]
    group = k if group_size == -1 else group_size
    scales, zeros = check_side_tensors(n, k, group, scales, zeros, bias)
    if norm_weight is not None:
        if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
            raise ValueError(f"norm_weight must be [{k}] in {x.dtype}")
        norm_weight = _aligned(norm_weight)
    if rope is not None:
        rope.check(x, n)
    pairs = silu_out or rope is not None  # the epilogue pairs rows
    cfg = config or tile_for(n, k, x.device)[0]
    if config is None and pairs and cfg.rows % 2:  # round up
        even = dataclasses.replace(cfg, rows=cfg.rows + 1)
        cfg = even if even.fits(k) else default_config(n, k)
    threads = cfg.threads(k)
    if not cfg.fits(k) or (pairs and cfg.rows % 2):
        raise ValueError(f"config {cfg.describe()} does not fit K={k}"
                         + (" with an epilogue that pairs rows (rows must be even)"
                            if pairs else ""))
    if rope is not None:
        y = torch.empty(*x.shape[:-1], rope.num_q_heads * rope.head_dim, dtype=x.dtype,
                        device=x.device)
    else:
        y = gemv_output(x, n, residual, silu_out)
    if n == 0:
        return y
    x1 = _aligned(x.reshape(x.shape[-1]))
    kern = cuda_rtc.get_kernel(_source()[0], "gemv_w4", x.device, {
        "ROWS": cfg.rows, "CHUNKS": cfg.chunks, "THREADS": threads,
        "X_BF16": int(x.dtype == torch.bfloat16), "SCALE_KIND": SCALE_KINDS[scales.dtype],
        "HAS_ZEROS": int(zeros is not None), "HAS_BIAS": int(bias is not None),
        "MATH": cfg.math, "PROLOGUE": 1 if norm_weight is not None else (2 if silu else 0),
        "RESIDUAL": int(residual is not None), "SILU_OUT": int(silu_out),
        "ROPE": int(rope is not None), "HEAD_DIM": rope.head_dim if rope is not None else 0,
        "MIN_BLOCKS": cfg.min_blocks},
        _source()[1])
    ptr = ctypes.c_void_p
    args = [ptr(x1.data_ptr()), ptr(weight.data_ptr()), ptr(scales.data_ptr()),
            ptr(zeros.data_ptr() if zeros is not None else 0),
            ptr(bias.data_ptr() if bias is not None else 0), ptr(y.data_ptr()),
            ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(group),
            ctypes.c_longlong(weight.stride(0) // 4), ctypes.c_longlong(scales.stride(0)),
            ctypes.c_longlong(zeros.stride(0) if zeros is not None else 0),
            ctypes.c_uint(MAGIC_2_23),
            ptr(norm_weight.data_ptr() if norm_weight is not None else 0),
            ctypes.c_float(eps)] + (rope.args() if rope is not None else _NO_ROPE) \
        + l2_prefetch.kernel_args(prefetch)
    grid = -(-(n // 2) // (cfg.rows // 2)) if pairs else -(-n // cfg.rows)
    kern.launch(grid, threads, args, pdl=pdl.enabled())
    return y

