"""Batch-1 FP8 W8A8 GEMV in CUDA C (NVRTC): on the tensor cores (`csrc/gemv_fp8.cu`) or on the
CUDA cores (`csrc/gemv_fp8_cc.cu`, a config with `cc_rows`: a block of K/16 threads owns
`cc_rows` rows, one 16-byte load of each per thread, laid out like the int4 GEMV).

y = fp8_linear's product for one activation row that is already quantized per token
(`gemv_fp8.quantize_row_fp8`, or the RMSNorm kernel's FP8 output): e4m3 weights [N, K] with an
fp32 scale per row, x_q [..., K] (e4m3 values held in bf16/fp16) and x_scale fp32 [1]. Each
16-byte weight load feeds two e4m3 mma.m16n8k32 whose A holds the one activation row; every
weight load of a thread is issued before the PDL wait (see the .cu). Products of e4m3 values
are exact; each mma's 32 products are summed by the tensor core, then added in fp32, so the
result matches `gemv_fp8.fp8_gemv_ref` up to summation order.

`supports` says whether a call can take it (compute capability 8.9+ for the e4m3 mma, CUDA C
kernels available, K a multiple of 64, 16-byte aligned rows); callers use the Triton GEMV
otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from llmaccel.kernels import cuda_rtc, l2_prefetch, pdl

MIN_CAPABILITY = (8, 9)
MAX_WARPS = 32
MAX_LOADS = 16  # 16-byte loads per lane and row group (4 registers each)
_LOAD_CHOICES = (8, 4, 6, 12, 16, 10, 7, 5, 14, 3, 2, 9, 11, 13, 15, 1)


@dataclass(frozen=True)
class CudaGemvFp8Config:
    loads: int = 8  # 16-byte loads per lane and row group: K = 64 * warps * loads
    rg: int = 1  # groups of 8 rows per block
    cc_rows: int = 0  # > 0: the CUDA-core kernel, this many rows per block (loads, rg unused)

    def describe(self) -> str:
        if self.cc_rows:
            return f"cuda-cc-r{self.cc_rows}"
        return f"cuda-mma-l{self.loads}g{self.rg}"

    def warps(self, k: int) -> int:
        if self.cc_rows:
            return -(-(k // 16) // 32)
        return k // (64 * self.loads)

    def fits(self, k: int) -> bool:
        if self.cc_rows:
            return k % 16 == 0 and 1 <= self.warps(k) <= MAX_WARPS and 1 <= self.cc_rows <= 8
        return (k % (64 * self.loads) == 0 and 1 <= self.warps(k) <= MAX_WARPS
                and self.loads * self.rg <= MAX_LOADS)


def default_config(n: int, k: int) -> CudaGemvFp8Config | None:
    """8 loads per lane where K allows (else the nearest that fits), one row group."""
    for loads in _LOAD_CHOICES:
        cfg = CudaGemvFp8Config(loads, 1)
        if cfg.fits(k):
            return cfg
    return None


def default_cc_config(n: int, k: int) -> CudaGemvFp8Config | None:
    """The CUDA-core kernel's untuned tile: 2 rows per block, the fastest or within 0.3% of it
    on all four llama-3.2-3b shapes on an H100; None where K is
    not a multiple of 16 or needs over 1024 threads."""
    cfg = CudaGemvFp8Config(cc_rows=2)
    return cfg if cfg.fits(k) else None


def chosen_config(n: int, k: int) -> CudaGemvFp8Config | None:
    """The tile an untuned call takes: the CUDA-core kernel's (gemv_fp8_cc.cu) where it fits,
    else the tensor-core kernel's (gemv_fp8.cu; slower where both fit: ptxas lowers its e4m3
    mma to fp16 HMMA)."""
    return default_cc_config(n, k) or default_config(n, k)


@functools.lru_cache(maxsize=1)
def _source() -> tuple[str, dict[str, str]]:
    """The kernel's source and the header it includes."""
    return cuda_rtc.source_files("gemv_fp8.cu", "common.cuh")


@functools.lru_cache(maxsize=1)
def _source_cc() -> tuple[str, dict[str, str]]:
    """The CUDA-core kernel's source and the header it includes."""
    return cuda_rtc.source_files("gemv_fp8_cc.cu", "common.cuh")


@functools.lru_cache(maxsize=8)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def supports(x_q: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether `fp8_gemv_cuda` takes this call (else the Triton GEMV)."""
    k = x_q.shape[-1]
    return (x_q.is_cuda and x_q.numel() == k and x_q.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == torch.float8_e4m3fn and weight.dim() == 2
            and weight.shape[1] == k and weight.stride(1) == 1 and weight.stride(0) % 16 == 0
            and weight.data_ptr() % 16 == 0 and weight_scale.numel() == weight.shape[0]
            and weight_scale.dtype == torch.float32 and default_config(weight.shape[0], k)
            is not None and cuda_rtc.available(x_q.device)
            and _capable(x_q.device.index if x_q.device.index is not None
                         else torch.cuda.current_device()))


def fp8_gemv_cuda(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                  weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                  config: CudaGemvFp8Config | None = None, silu_out: bool = False,
                  prefetch: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """y [..., N] in x_q's dtype (`silu_out`: a [gate; up] layer, N = 2I, returns
    silu_and_mul(y) [..., I], computed in the epilogue). `prefetch`: ranges of a later
    kernel's weights for the blocks to prefetch into L2 (`kernels/l2_prefetch.py`)."""
    if not supports(x_q, weight, weight_scale):
        raise ValueError(f"fp8_gemv_cuda cannot take x {tuple(x_q.shape)} {x_q.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if x_scale.numel() != 1 or x_scale.dtype != torch.float32:
        raise ValueError("x_scale must be one fp32 value")
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != x_q.dtype):
        raise ValueError(f"bias must be [{n}] in {x_q.dtype}")
    if silu_out and n % 2:
        raise ValueError("silu_out needs an even N ([gate; up] rows)")
    cfg = config or chosen_config(n, k)
    if not cfg.fits(k) or (silu_out and cfg.cc_rows % 2):
        raise ValueError(f"config {cfg.describe()} does not fit K={k}"
                         + (" with silu_out (rows must be even)" if silu_out else ""))
    y = torch.empty(*x_q.shape[:-1], n // 2 if silu_out else n, dtype=x_q.dtype,
                    device=x_q.device)
    if n == 0:
        return y
    x1 = x_q.reshape(k)
    if not x1.is_contiguous() or x1.data_ptr() % 16:
        x1 = x1.contiguous().clone()
    ws = weight_scale.reshape(n)
    if not ws.is_contiguous():
        ws = ws.contiguous()
    common = {"X_BF16": int(x_q.dtype == torch.bfloat16), "HAS_BIAS": int(bias is not None),
              "SILU_OUT": int(silu_out)}
    if cfg.cc_rows:
        kern = cuda_rtc.get_kernel(_source_cc()[0], "gemv_fp8_cc", x_q.device, {
            "THREADS": 32 * cfg.warps(k), "ROWS": cfg.cc_rows, **common}, _source_cc()[1])
    else:
        kern = cuda_rtc.get_kernel(_source()[0], "gemv_fp8", x_q.device, {
            "WARPS": cfg.warps(k), "LOADS": cfg.loads, "RG": cfg.rg, **common}, _source()[1])
    ptr = ctypes.c_void_p
    args = [ptr(x1.data_ptr()), ptr(x_scale.data_ptr()), ptr(weight.data_ptr()),
            ptr(ws.data_ptr()), ptr(bias.data_ptr() if bias is not None else 0),
            ptr(y.data_ptr()), ctypes.c_int(n), ctypes.c_int(k),
            ctypes.c_longlong(weight.stride(0))] + l2_prefetch.kernel_args(prefetch)
    rows = cfg.cc_rows or 8 * cfg.rg
    grid = -(-(n // 2) // (rows // 2)) if silu_out else -(-n // rows)
    kern.launch(grid, 32 * cfg.warps(k), args, pdl=pdl.enabled())
    return y
