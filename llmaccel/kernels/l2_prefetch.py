"""L2 prefetch ranges for the batch-1 CUDA C GEMVs (`csrc/common.cuh` `l2_prefetch_share`).

At batch 1 a decode step is a chain of small kernels. Each GEMV streams its weights from HBM,
but between GEMVs (an RMSNorm, the attention decode, a kernel's ramp and tail) HBM idles. A
GEMV launched with prefetch ranges also issues Hopper bulk L2 prefetches
(`cp.async.bulk.prefetch.L2`) for the first bytes of the next GEMV's weights, from its last
blocks (`tail_blocks`), before their PDL wait: those bytes arrive in L2 through the kernel's
tail and the kernels in between, and the next GEMV's first loads hit L2.
`models/l2_prefetch.py` decides which layer prefetches which.

A range is (device address, bytes): 16-byte aligned, a multiple of 16 bytes (what the
instruction takes). A kernel takes at most `MAX_RANGES`; an empty slot is (0, 0).
"""

from __future__ import annotations

import ctypes

import torch

MAX_RANGES = 2
Range = tuple[int, int]


# From an H100: 2 MiB per GEMV issued by its last 66 blocks took a llama-3.2-3b int4 decode
# step from 1099 to 1072 us (FP8: 1708 to 1662). Prefetching more hurt: 8 MiB or more, or any
# cap issued by every block, slowed the GEMV chains 4-12% (the prefetch competes with the
# kernel's own loads); a larger cap across the attention alone (qkv -> o) changed nothing.
CAP_BYTES = 2 << 20
TAIL_BLOCKS = 66


def cap_bytes() -> int:
    """The most bytes one GEMV prefetches for the next."""
    return CAP_BYTES


def tail_blocks() -> int:
    """How many of a GEMV's last blocks issue its prefetch (0: every block)."""
    return TAIL_BLOCKS


def ranges_of(tensors: list[torch.Tensor], cap: int, cuda_only: bool = True
              ) -> tuple[Range, ...]:
    """Ranges covering `tensors` in order, at most `cap` bytes in all and `MAX_RANGES` of them:
    a tensor that does not fit whole is cut to its first bytes (the rows its consumer's first
    blocks read). Tensors not contiguous, not 16-byte aligned or (`cuda_only`, the kernels'
    case; off for CPU tests of the bookkeeping) off CUDA are skipped."""
    out: list[Range] = []
    left = cap
    for t in tensors:
        if len(out) == MAX_RANGES or left < 16:
            break
        if t is None or (cuda_only and not t.is_cuda) or not t.is_contiguous() or t.data_ptr() % 16:
            continue
        n = min(t.numel() * t.element_size(), left) // 16 * 16
        if n:
            out.append((t.data_ptr(), n))
            left -= n
    return tuple(out)


def kernel_args(ranges: tuple[Range, ...] | None, tail: int | None = None) -> list:
    """The GEMV kernels' trailing arguments: (pointer, bytes) x MAX_RANGES, then how many of
    the grid's last blocks share them (`tail_blocks()` where None)."""
    ranges = tuple(ranges or ())
    if len(ranges) > MAX_RANGES:
        raise ValueError(f"at most {MAX_RANGES} prefetch ranges, got {len(ranges)}")
    args: list = []
    for ptr, n in ranges + ((0, 0),) * (MAX_RANGES - len(ranges)):
        if ptr % 16 or n % 16 or n < 0:
            raise ValueError(f"prefetch range ({ptr:#x}, {n}) must be 16-byte aligned and a "
                             "multiple of 16 bytes")
        args += [ctypes.c_void_p(ptr), ctypes.c_longlong(n)]
    return args + [ctypes.c_int(tail_blocks() if tail is None else tail)]


def layer_ranges(layer: torch.nn.Module) -> tuple[Range, ...]:
    """The ranges a layer's batch-1 GEMV passes on: what `models/l2_prefetch.py` linked to it
    (none where it ran no link)."""
    return getattr(layer, "l2_prefetch", ())
