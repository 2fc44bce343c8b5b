"""W4A16 GEMM on tensor cores for 2+ rows, in CUDA C (`csrc/gemm_w4.cu`, NVRTC via `cuda_rtc`).

y [M, N] = x [M, K] @ dequant(weight)^T (+ bias) on the int4 layout of `kernels/gemm.py`
(weight int32 [N, K/8], scales [N, G] bf16/fp16/fp32, uint8 zeros [N, G] or None for zero
point 8), reading the codes directly: prefill and batched decode steps without the dequantize
+ cuBLAS pair, which writes and re-reads every weight in bf16 (`quant/linear_methods.py` used
it from 32 rows). mma.sync m16n8k16 with fp32 accumulators; each group's exact (code - zero)
x products are scaled once in fp32, as the batch-1 GEMV does (`csrc/gemv_w4.cu`).

`supports` says whether a call can take it (CUDA C kernels available, bf16/fp16 activations,
K a multiple of the tile's K step, N a multiple of 8, the group a multiple of 32, aligned
rows); `config_for(m)` picks the tile by row count. The reference is `gemm.linear_ref`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from llmaccel.kernels import cuda_rtc, pdl
from llmaccel.kernels.gemv_w4 import check_side_tensors
from llmaccel.kernels.gemv_w4_cuda import SCALE_KINDS

MAX_SHARED = 227 * 1024  # an H100 block's dynamic shared memory limit


@dataclass(frozen=True)
class GemmW4Config:
    """A block of wm x wn warps, each owning mt m16 tiles and ntw n8 tiles; K in stages of
    32 * cps, `stages` of them in flight."""

    wm: int
    wn: int
    mt: int
    ntw: int
    cps: int = 2
    stages: int = 4
    lean: bool = False  # fewer integer instructions a stage (LEAN in the .cu; the defaults)
    splitk: int = 1  # K in this many parts, added by each tile's last block (an experiment)

    @property
    def block_m(self) -> int:
        return 16 * self.mt * self.wm

    @property
    def block_n(self) -> int:
        return 8 * self.ntw * self.wn

    @property
    def block_k(self) -> int:
        return 32 * self.cps

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    def groups_per_stage(self, group_chunks: int) -> int:
        """Scale (and zero) words per row a stage carries (0: per channel, none)."""
        if group_chunks == 0:
            return 0
        return 1 if group_chunks >= self.cps else self.cps // group_chunks

    def shared_bytes(self, group_chunks: int = 4, zeros: bool = False) -> int:
        side = self.block_n * self.groups_per_stage(group_chunks) * 4 * (2 if zeros else 1)
        return self.stages * (self.block_m * self.block_k * 2 + self.block_n * self.block_k // 2
                              + side)

    def describe(self) -> str:
        return (f"w{self.wm}x{self.wn}-m{self.mt}n{self.ntw}-k{self.block_k}"
                f"s{self.stages}" + ("L" if self.lean else "")
                + (f"-split{self.splitk}" if self.splitk > 1 else ""))

    def valid(self) -> bool:
        return (min(self.wm, self.wn, self.mt, self.ntw) >= 1 and self.cps in (1, 2, 4)
                and self.stages >= 2 and self.threads <= 1024
                and self.threads % (4 * self.cps) == 0  # fixed copy columns a thread
                and 1 <= self.splitk <= 16
                and self.shared_bytes(1, True) <= MAX_SHARED)  # the most side bytes


# Tiles, from the sweeps on the llama-3.2-3b shapes (H100):
# all LEAN, which was faster on every shape and row count (8-128 rows: 4-20%). Up to 16 rows one
# m16 tile a warp and 32 columns a block, or 64 where 32 would take more than one wave of
# blocks; above, the tallest block that still gives the grid two blocks an SM, else 32 x 64.
DECODE_NARROW = GemmW4Config(wm=1, wn=4, mt=1, ntw=1, cps=4, stages=4, lean=True)  # 16 x 32
DECODE_WIDE = GemmW4Config(wm=1, wn=4, mt=1, ntw=2, cps=4, stages=3, lean=True)    # 16 x 64
TALL = (GemmW4Config(wm=2, wn=2, mt=4, ntw=4, cps=4, stages=3, lean=True),         # 128 x 64
        GemmW4Config(wm=2, wn=2, mt=2, ntw=4, cps=4, stages=3, lean=True))         # 64 x 64
SHORT = GemmW4Config(wm=1, wn=4, mt=2, ntw=2, cps=4, stages=4, lean=True)          # 32 x 64
DEFAULT_CONFIGS = (DECODE_NARROW, DECODE_WIDE, *TALL, SHORT)
MIN_BLOCKS = 256  # two blocks per SM of an H100 (132 SMs), about
ONE_WAVE = 132  # blocks: one per SM of an H100


def config_for(m: int, n: int) -> GemmW4Config:
    """The tile for m rows of an N-column layer. Measured (run 6, us): at 8-16 rows 16 x 32 on
    o and down (8.5 / 20.1) and 16 x 64 on qkv and gate_up (11.1 / 16.3; 16 x 32 gives qkv 160
    blocks, more than a wave: 11.5); at 128 rows 32 x 64 on qkv, o and down (28.6 / 20.2 /
    51.3) and 128 x 64 on gate_up (49.7)."""
    if m <= 16:
        return DECODE_NARROW if -(-n // DECODE_NARROW.block_n) <= ONE_WAVE else DECODE_WIDE
    for cfg in TALL:
        if cfg.block_m <= -(-m // 16) * 16 and \
                -(-m // cfg.block_m) * -(-n // cfg.block_n) >= MIN_BLOCKS:
            return cfg
    return SHORT


@functools.lru_cache(maxsize=1)
def _source() -> tuple[str, dict[str, str]]:
    return cuda_rtc.source_files("gemm_w4.cu", "common.cuh")


def supports(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
             config: GemmW4Config | None = None) -> bool:
    """Whether `w4a16_gemm_cuda` takes this call (else dequantize + cuBLAS or Triton)."""
    k = x.shape[-1]
    n = weight.shape[0]
    group = k if group_size == -1 else group_size
    cfg = config or config_for(max(1, x.numel() // max(k, 1)), n)
    gc = group // 32
    stages = k // cfg.block_k if k % cfg.block_k == 0 else 0
    # K splits of whole stages and whole groups
    split_ok = cfg.splitk == 1 or (
        stages % cfg.splitk == 0
        and (group == k or (stages // cfg.splitk) * cfg.cps % gc == 0))
    # A stage holds whole groups or lies in one; a stage's scales (zeros) are copied as the
    # 4-byte words that hold them, so a row's groups must start word-aligned.
    side_ok = group == k or (
        (gc % cfg.cps == 0 or cfg.cps % gc == 0)
        and scales.stride(0) * scales.element_size() % 4 == 0
        and (zeros is None or zeros.stride(0) % 4 == 0))
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() >= 1
            and k > 0 and k % cfg.block_k == 0 and group % 32 == 0 and k % group == 0
            and side_ok and split_ok
            and n % 8 == 0 and weight.dtype == torch.int32 and weight.dim() == 2
            and weight.shape[1] == k // 8 and weight.stride(1) == 1
            and weight.stride(0) % 4 == 0 and weight.data_ptr() % 16 == 0
            and scales.dtype in SCALE_KINDS and (bias is None or bias.dtype == x.dtype)
            and cuda_rtc.available(x.device))


@dataclass
class _Prepared:
    """What a call needs beyond x and y, worked out once per weight, dtype and tile (the
    checks, the compiled kernel, the fixed launch arguments): eager prefill calls each layer
    once a step, and none of this changes between calls."""

    kernel: cuda_rtc.CudaKernel
    static: list  # ctypes args: weight, scales, zeros, bias
    strides: list  # ctypes args: weight, scales and zeros row strides
    n: int
    k: int
    shared: int
    sms: int  # the GPU's multiprocessors
    arrivals: torch.Tensor | None  # SPLITK > 1: a counter a tile, zero between launches


_prepared: dict[tuple, _Prepared] = {}
SPLITK_MAX_TILES = 1 << 16  # tiles a split-K launch may have
_arrival_counters: dict[torch.device, torch.Tensor] = {}


def splitk_arrivals(device: torch.device) -> torch.Tensor:
    """The split-K tiles' arrival counters of `device` (this GEMM's and the wgmma one's),
    allocated (zeroed) at the first call, before any graph capture; each launch leaves them at
    zero. One stream at a time."""
    t = _arrival_counters.get(device)
    if t is None:
        t = _arrival_counters[device] = torch.zeros(SPLITK_MAX_TILES, dtype=torch.int32,
                                                    device=device)
    return t


def _prepare(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
             cfg: GemmW4Config) -> _Prepared:
    k = x.shape[-1]
    n = weight.shape[0]
    if not cfg.valid():
        raise ValueError(f"gemm_w4 tile {cfg} is not valid")
    if not supports(x, weight, scales, zeros, group_size, bias, cfg):
        raise ValueError(f"w4a16_gemm_cuda cannot take x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, group {group_size} with tile "
                         f"{cfg.describe()}")
    group = k if group_size == -1 else group_size
    checked, zeros_c = check_side_tensors(n, k, group, scales, zeros, bias)
    if checked.data_ptr() != scales.data_ptr() or (
            zeros is not None and zeros_c.data_ptr() != zeros.data_ptr()):
        raise ValueError("scales and zeros must be contiguous")
    gc = 0 if group == k else group // 32
    kern = cuda_rtc.get_kernel(_source()[0], "gemm_w4", x.device, {
        "WM": cfg.wm, "WN": cfg.wn, "MT": cfg.mt, "NTW": cfg.ntw, "CPS": cfg.cps,
        "STAGES": cfg.stages, "X_BF16": int(x.dtype == torch.bfloat16),
        "SCALE_KIND": SCALE_KINDS[scales.dtype], "HAS_ZEROS": int(zeros is not None),
        "HAS_BIAS": int(bias is not None), "GROUP_CHUNKS": gc,
        "LEAN": int(cfg.lean), "SPLITK": cfg.splitk}, _source()[1])
    ptr = ctypes.c_void_p
    return _Prepared(
        kernel=kern,
        static=[ptr(weight.data_ptr()), ptr(scales.data_ptr()),
                ptr(zeros.data_ptr() if zeros is not None else 0),
                ptr(bias.data_ptr() if bias is not None else 0)],
        strides=[ctypes.c_longlong(weight.stride(0)), ctypes.c_longlong(scales.stride(0)),
                 ctypes.c_longlong(zeros.stride(0) if zeros is not None else 0)],
        n=n, k=k, shared=cfg.shared_bytes(gc, zeros is not None),
        sms=torch.cuda.get_device_properties(x.device).multi_processor_count,
        arrivals=splitk_arrivals(x.device) if cfg.splitk > 1 else None)


def w4a16_gemm_cuda(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None, group_size: int,
                    bias: torch.Tensor | None = None,
                    config: GemmW4Config | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(weight)^T (+ bias), in x's dtype. The first call for
    a weight (by address, shape and dtype), activation dtype and tile checks everything
    (ValueError naming what it cannot take); later ones only x."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    cfg = config or config_for(m, weight.shape[0])
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
    m_tiles = -(-m // cfg.block_m)
    grid = m_tiles * -(-n // cfg.block_n)
    # Programmatic dependent launch only for a one-wave grid, which also releases its own
    # dependent early (after its wait), as the batch-1 GEMVs do. Launched early, a larger
    # grid's blocks (up to 72 KiB of shared memory and 255 registers a thread each) would sit
    # on the SMs in their wait while the kernel before them still needs them. The slow
    # prefill that suggested this turned out to be the tile choice (profiles with and without
    # it); kept as the safe choice, and its
    # effect on 2-16-row decode steps (gate_up's 256 blocks on the 3B shape) is not measured.
    if cfg.splitk > 1 and grid > SPLITK_MAX_TILES:
        raise ValueError(f"split-K GEMM of {grid} tiles: at most {SPLITK_MAX_TILES}")
    partial = (torch.empty(cfg.splitk * m * n, dtype=torch.float32, device=x.device)
               if cfg.splitk > 1 else None)
    grid *= cfg.splitk
    one_wave = grid <= prep.sms
    args = [ctypes.c_void_p(x2.data_ptr()), *prep.static, ctypes.c_void_p(y.data_ptr()),
            ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_longlong(x2.stride(0)),
            *prep.strides, ctypes.c_longlong(y.stride(0)), ctypes.c_int(m_tiles),
            ctypes.c_int(int(one_wave))]
    if partial is not None:  # the SPLITK > 1 kernel's two extra parameters
        args += [ctypes.c_void_p(partial.data_ptr()), ctypes.c_void_p(prep.arrivals.data_ptr())]
    prep.kernel.launch(grid, cfg.threads, args, pdl=pdl.enabled() and one_wave,
                       shared_mem=prep.shared)
    return y.reshape(*x.shape[:-1], n)
