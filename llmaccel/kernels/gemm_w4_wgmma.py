"""W4A16 GEMM on Hopper's warpgroup MMA (`csrc/gemm_w4_wgmma.cu`, NVRTC for sm_90a).

y [M, N] = x [M, K] @ dequant(weight)^T (+ bias) on the int4 layout of `kernels/gemm.py`
(weight int32 [N, K/8], scales [N, G] bf16/fp16/fp32, uint8 zeros [N, G] or None for zero
point 8). The weights are wgmma's A operand, dequantized in registers to exactly the
reference's 16-bit weight; x is its B operand in shared memory. For prefill-sized row counts,
where the mma.sync GEMM (`gemm_w4_cuda.py`) is bound by instruction issue.

`supports` says whether a call can take it (an sm_90 GPU, CUDA C kernels available, bf16/fp16
activations, K a multiple of the tile's k step, groups a multiple of it or per channel, N a
multiple of 8, aligned rows); `config_for(m, n, k)` picks the tile. The
reference is `gemm.linear_ref`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from llmaccel.kernels import cuda_rtc, pdl
from llmaccel.kernels.gemm_w4_cuda import SPLITK_MAX_TILES, splitk_arrivals
from llmaccel.kernels.gemv_w4 import check_side_tensors
from llmaccel.kernels.gemv_w4_cuda import SCALE_KINDS

MAX_SHARED = 227 * 1024  # an H100 block's dynamic shared memory limit


@dataclass(frozen=True)
class WgmmaW4Config:
    """A block of `wgs` warpgroups (64 weight rows each) against `bm` rows of x (the wgmma N),
    K in stages of 64, `stages` in flight, K split into `splitk` parts."""

    bm: int
    wgs: int = 1
    stages: int = 4
    splitk: int = 1
    acc: int = 1  # accumulator sets (independent wgmma chains), summed at the end
    fence: bool = True  # fence.proxy.async each stage (PROXY_FENCE)
    diag: int = 0  # timing experiments only (DIAG in the .cu): the results are wrong
    ksteps: int = 4  # k16 steps a stage (KSTEPS): 64, 128 or 256 k a stage
    # scales not in the activation dtype: as hi + lo in it (SCALE_SPLIT, faster; 1 ulp off the
    # reference's weight now and then), else an exact fp32 product per weight
    split_scale: bool = True

    @property
    def block_k(self) -> int:
        return 16 * self.ksteps

    @property
    def block_n(self) -> int:
        return 64 * self.wgs

    @property
    def threads(self) -> int:
        return 128 * self.wgs

    def stage_bytes(self, grouped: bool, zeros: bool) -> int:
        side = self.block_n * 4 * ((1 + int(zeros)) if grouped else 0)
        raw = self.bm * 2 * self.block_k + self.block_n * self.block_k // 2 + side
        return -(-raw // 1024) * 1024

    def shared_bytes(self, grouped: bool = True, zeros: bool = False) -> int:
        pipeline = self.stages * self.stage_bytes(grouped, zeros)
        epilogue = self.bm * (self.block_n + 8) * 2
        return max(pipeline, epilogue) + 1024  # room to 1024-align the start

    def describe(self) -> str:
        return (f"wg{self.wgs}-n{self.block_n}-m{self.bm}-k{self.block_k}-s{self.stages}"
                + (f"-acc{self.acc}" if self.acc > 1 else "")
                + ("" if self.fence else "-nofence")
                + (f"-diag{self.diag}" if self.diag else "")
                + ("" if self.split_scale else "-exact")
                + (f"-split{self.splitk}" if self.splitk > 1 else ""))

    def valid(self) -> bool:
        return (self.bm % 8 == 0 and 8 <= self.bm <= 256 and self.wgs in (1, 2)
                and self.stages >= 3 and 1 <= self.splitk <= 16
                and self.acc in (1, 2, 4) and self.acc * self.bm <= 256  # registers
                and self.ksteps in (4, 8, 16)
                and self.shared_bytes(True, True) <= MAX_SHARED)


def config_for(m: int, n: int, k: int, group: int = -1, sms: int = 132) -> WgmmaW4Config:
    """The tile for m rows of an N x K layer (group: the quantization group, -1 per channel),
    from the H100 sweeps on the llama-3.2-3b shapes at 64, 128 and 256 rows: 128 k a stage where the group allows it; wide layers (gate_up
    from 65 rows, anything of 4096+ columns above 128) take two warpgroups on one x tile of 128
    rows (256 for gate_up above 128) and 64 k a stage; the rest x tiles of 64 rows up to 64,
    or up to 128 for layers under 4096 columns, else 128. K is split where the grid is small
    and K long (o and down at 64 rows: 2 ways; down at 128: 4 ways)."""
    bk = 128 if k % 128 == 0 and (group in (-1, k) or group % 128 == 0) else 64
    wide = (n >= 8192 and m > 64) or (n >= 4096 and m > 128)
    if wide:
        wgs, bk = 2, 64
        bm = 256 if m > 128 and n >= 8192 else 128
    else:
        wgs = 1
        bm = 64 if m <= 64 or (m <= 128 and n < 4096) else 128
    tiles = -(-m // bm) * -(-n // (64 * wgs))
    stages = k // bk
    split = 1
    if m <= 128:
        for s, max_tiles, min_stages in ((2, sms // 2, 12), (4, sms * 3 // 4, 16)):
            if tiles <= max_tiles and stages % s == 0 and stages // s >= min_stages and (
                    group in (-1, k) or (stages // s) % max(1, group // bk) == 0):
                split = s
                break
    cfg = WgmmaW4Config(bm, wgs, 4, split, ksteps=bk // 16)
    return cfg if cfg.valid() else WgmmaW4Config(bm, wgs, 3, split, ksteps=bk // 16)


def wgmma_header(bm: int, bf16: bool) -> str:
    """wgmma_inst.cuh for a tile of `bm` x rows: `wgmma_m64k16(d, a0..a3, desc)`, one
    m64n{bm}k16 with A from registers and B from the descriptor, accumulating into d[bm / 2]
    (the operand list depends on bm, so the host writes it)."""
    n = bm // 2
    dt = "bf16" if bf16 else "f16"
    outs = ", ".join(f"%{i}" for i in range(n))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (
        "#pragma once\n"
        "__device__ __forceinline__ void wgmma_m64k16(float* d, u32 a0, u32 a1, u32 a2, u32 a3,"
        " unsigned long long desc) {\n"
        f'  asm volatile("wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.{dt}.{dt} "\n'
        f'               "{{{outs}}}, "\n'
        f'               "{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, 1, 1, 1, 0;"\n'
        f"               : {cons}\n"
        '               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc) : "memory");\n'
        "}\n")


@functools.lru_cache(maxsize=1)
def _source() -> tuple[str, dict[str, str]]:
    return cuda_rtc.source_files("gemm_w4_wgmma.cu", "common.cuh")


def kernel_defines(cfg: WgmmaW4Config, bf16: bool, zeros: bool, bias: bool,
                   group_stages: int, scale_kind: int | None = None) -> dict[str, int]:
    """The .cu's macros; `group_stages` = group / the tile's block_k (0: per channel)."""
    return {"BM": cfg.bm, "WGS": cfg.wgs, "STAGES": cfg.stages, "SPLITK": cfg.splitk,
            "ACC": cfg.acc, "PROXY_FENCE": int(cfg.fence), "DIAG": cfg.diag,
            "KSTEPS": cfg.ksteps,
            "SCALE_KIND": (0 if bf16 else 1) if scale_kind is None else scale_kind,
            "SCALE_SPLIT": int(cfg.split_scale),
            "X_BF16": int(bf16), "HAS_ZEROS": int(zeros), "HAS_BIAS": int(bias),
            "GROUP_STAGES": group_stages}


def kernel_headers(cfg: WgmmaW4Config, bf16: bool) -> dict[str, str]:
    return {**_source()[1], "wgmma_inst.cuh": wgmma_header(cfg.bm, bf16)}


def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def supports(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
             config: WgmmaW4Config | None = None) -> bool:
    """Whether `w4a16_gemm_wgmma` takes this call."""
    k = x.shape[-1]
    n = weight.shape[0]
    group = k if group_size == -1 else group_size
    m = max(1, x.numel() // max(k, 1))
    cfg = config or config_for(m, n, k, group)
    bk = cfg.block_k
    stages = k // bk if k % bk == 0 else 0
    split_ok = cfg.splitk == 1 or (
        stages % cfg.splitk == 0
        and (group == k or (stages // cfg.splitk) % max(1, group // bk) == 0))
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() >= 1
            and k > 0 and k % bk == 0 and k % group == 0 and split_ok
            and (group == k or group % bk == 0)
            and cfg.valid() and n % 8 == 0 and weight.dtype == torch.int32 and weight.dim() == 2
            and weight.shape[1] == k // 8 and weight.stride(1) == 1
            and weight.stride(0) % 4 == 0 and weight.data_ptr() % 16 == 0
            and scales.dtype in SCALE_KINDS and (bias is None or bias.dtype == x.dtype)
            and cuda_rtc.available(x.device) and _sm90(x.device))


@dataclass
class _Prepared:
    kernel: cuda_rtc.CudaKernel
    static: list  # ctypes args: weight, scales, zeros, bias
    strides: list  # ctypes args: weight, scales, zeros row strides
    n: int
    k: int
    group: int
    shared: int
    sms: int
    arrivals: torch.Tensor | None


_prepared: dict[tuple, _Prepared] = {}


def _prepare(x, weight, scales, zeros, group_size, bias, cfg) -> _Prepared:
    k = x.shape[-1]
    n = weight.shape[0]
    if not supports(x, weight, scales, zeros, group_size, bias, cfg):
        raise ValueError(f"w4a16_gemm_wgmma cannot take x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, scales {scales.dtype}, group "
                         f"{group_size} with tile {cfg.describe()}")
    group = k if group_size == -1 else group_size
    checked, zeros_c = check_side_tensors(n, k, group, scales, zeros, bias)
    if checked.data_ptr() != scales.data_ptr() or (
            zeros is not None and zeros_c.data_ptr() != zeros.data_ptr()):
        raise ValueError("scales and zeros must be contiguous")
    bf16 = x.dtype == torch.bfloat16
    group_stages = 0 if group == k else group // cfg.block_k
    kern = cuda_rtc.get_kernel(
        _source()[0], "gemm_w4_wgmma", x.device,
        kernel_defines(cfg, bf16, zeros is not None, bias is not None, group_stages,
                       SCALE_KINDS[scales.dtype]),
        kernel_headers(cfg, bf16), arch_suffix="a")
    ptr = ctypes.c_void_p
    return _Prepared(
        kernel=kern,
        static=[ptr(weight.data_ptr()), ptr(scales.data_ptr()),
                ptr(zeros.data_ptr() if zeros is not None else 0),
                ptr(bias.data_ptr() if bias is not None else 0)],
        strides=[ctypes.c_longlong(weight.stride(0)), ctypes.c_longlong(scales.stride(0)),
                 ctypes.c_longlong(zeros.stride(0) if zeros is not None else 0)],
        n=n, k=k, group=group, shared=cfg.shared_bytes(group_stages > 0, zeros is not None),
        sms=torch.cuda.get_device_properties(x.device).multi_processor_count,
        arrivals=splitk_arrivals(x.device) if cfg.splitk > 1 else None)


def w4a16_gemm_wgmma(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None = None,
                     config: WgmmaW4Config | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(weight)^T (+ bias), in x's dtype. The first call for a
    weight, activation dtype and tile checks everything (ValueError naming what it cannot
    take); later ones only x."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    cfg = config or config_for(m, weight.shape[0], k, group_size)
    key = (weight.data_ptr(), tuple(weight.shape), scales.data_ptr(), tuple(scales.shape),
           scales.dtype, None if zeros is None else zeros.data_ptr(),
           None if bias is None else bias.data_ptr(), x.dtype, x.device, group_size, cfg)
    prep = _prepared.get(key)
    if prep is None:
        prep = _prepared[key] = _prepare(x, weight, scales, zeros, group_size, bias, cfg)
    n = prep.n
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous().clone() if x2.data_ptr() % 16 else x2.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    m_tiles = -(-m // cfg.bm)
    tiles = m_tiles * -(-n // cfg.block_n)
    if cfg.splitk > 1 and tiles > SPLITK_MAX_TILES:
        raise ValueError(f"split-K GEMM of {tiles} tiles: at most {SPLITK_MAX_TILES}")
    grid = tiles * cfg.splitk
    args = [ctypes.c_void_p(x2.data_ptr()), *prep.static, ctypes.c_void_p(y.data_ptr()),
            ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_longlong(x2.stride(0)),
            *prep.strides, ctypes.c_longlong(y.stride(0)), ctypes.c_int(m_tiles),
            ctypes.c_int(prep.group)]
    if cfg.splitk > 1:
        partial = torch.empty(cfg.splitk * m * n, dtype=torch.float32, device=x.device)
        args += [ctypes.c_void_p(partial.data_ptr()), ctypes.c_void_p(prep.arrivals.data_ptr())]
    # PDL only for a grid that fits on the GPU at once (as gemm_w4_cuda: a dependent launched
    # early would park blocks on SMs a later wave needs)
    prep.kernel.launch(grid, cfg.threads, args, pdl=pdl.enabled() and grid <= prep.sms,
                       shared_mem=prep.shared)
    return y.reshape(*x.shape[:-1], n)
