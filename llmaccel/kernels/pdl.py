"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A batch-1 decode step is ~100-180 small kernels. Even inside a CUDA graph each kernel boundary
costs a few microseconds: the next kernel's programs are only scheduled once the previous grid
has drained, and then wait for their first loads from device memory. With PDL (compute
capability 9.0+, Hopper) a kernel is launched while its predecessor still runs; it may do work
that depends on nothing the predecessor writes (a GEMV streams its read-only weights) and then
waits at `griddepcontrol.wait` until the predecessor has finished and its writes are visible.

The rule every PDL kernel here keeps (and the reason it is safe to chain them): it calls
`gdc_wait()` before it reads anything another kernel of the step writes, and before it writes
anything at all. `gdc_wait()` returns once the previous grid has completed, and that grid
completed only after its own wait returned, so waiting on the previous kernel transitively
waits on all earlier ones, wherever a kernel calls `gdc_launch_dependents()`. Kernels launched
without PDL (torch's) serialize as usual.

Where `gdc_launch_dependents()` goes sets how far ahead kernels run. The GEMVs call it after
their wait; the small kernels between them (norms, rope + cache write, attention, SiLU-and-mul)
call it on entry (`EARLY_TRIGGER`, LLMACCEL_PDL_EARLY=0 for after the wait). So a GEMV is
launched while the small kernels before it (and the tail of the GEMV before them) still run,
and pulls its weights into L2 (`prefetch_l2`) at a time when HBM would otherwise sit idle, and
the next GEMV is not launched before this one's wait returned, which keeps at most about two
layers' weight matrices in flight in L2. (A launched grid's programs are all resident before
its dependent can launch, so early launches cannot starve the kernel they follow.)

Never on below compute capability 9.0 or in Triton's interpreter (CPU): there the plain launch
is the path, so nothing on the default path needs Hopper. On 9.0+ `configure` turns it on by
default where a probe kernel launched with PDL ran; LLMACCEL_PDL=0 turns it off (to measure
both, or to rule it out).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

PDL_MIN_CAPABILITY = (9, 0)
# Whether PDL is on (where supported) when neither the caller nor LLMACCEL_PDL says: set from
# measurement (benchmarks/results/2026-11-22-W1-fusion-h100-summary.md: graph replay -3%).
DEFAULT_ON = True
_enabled = False


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel finished and its writes are visible (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel start launching (its programs still wait before touching our data)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


# Small kernels release their dependent on entry (module docstring); read at import.
EARLY_TRIGGER = tl.constexpr(os.environ.get("LLMACCEL_PDL_EARLY", "1") == "1")


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The prologue of a kernel with nothing to prefetch: release the next kernel (on entry
    with EARLY_TRIGGER, else after the wait) and wait for the previous one."""
    if EARLY_TRIGGER:
        pdl_launch_dependents(USE_PDL)
        pdl_wait(USE_PDL)
    else:
        pdl_wait(USE_PDL)
        pdl_launch_dependents(USE_PDL)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding `ptrs` (a tensor of pointers), without waiting
    for them or holding registers: `prefetch.global.L2`. GPU only (inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


# GEMVs launched early pull their weights into L2 before their wait (module docstring);
# LLMACCEL_GEMV_PREFETCH=0 turns it off, to measure it.
GEMV_PREFETCH = os.environ.get("LLMACCEL_GEMV_PREFETCH", "1") == "1"


def gemv_prefetch() -> bool:
    """Whether a GEMV launched now should prefetch its weights into L2 (needs PDL on: without
    an early launch there is nothing to overlap)."""
    return _enabled and GEMV_PREFETCH and os.environ.get("TRITON_INTERPRET") != "1"


def enabled() -> bool:
    return _enabled


def set_enabled(value: bool) -> None:
    global _enabled
    _enabled = bool(value)


def launch_kwargs() -> dict[str, Any]:
    """Extra keyword arguments for a Triton launch: the PDL launch attribute when enabled."""
    return {"launch_pdl": True} if _enabled else {}


@triton.jit
def _probe_kernel(X, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    tl.store(X + tl.program_id(0), tl.load(X + tl.program_id(0)) + 1.0)


def _probe(device: torch.device) -> str | None:
    """Launch a PDL kernel twice; None if it ran and computed, else why not."""
    try:
        x = torch.zeros(4, device=device)
        for _ in range(2):
            _probe_kernel[(4,)](x, USE_PDL=True, launch_pdl=True)
        torch.cuda.synchronize(device)
        if not bool((x == 2).all()):
            return "the probe kernel computed a wrong value"
        return None
    except Exception as e:  # an older Triton without launch_pdl, a driver without PDL
        return f"{type(e).__name__}: {e}"


def supported(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= PDL_MIN_CAPABILITY


def configure(device: torch.device | str, requested: bool | None = None) -> bool:
    """Decide PDL for the kernels of this process (call before capturing CUDA graphs).
    `requested` None: LLMACCEL_PDL if set, else the default (off). Returns the decision."""
    if requested is None:
        env = os.environ.get("LLMACCEL_PDL")
        requested = env == "1" if env is not None else DEFAULT_ON
    use = False
    if requested and supported(device):
        why = _probe(torch.device(device))
        if why is None:
            use = True
        else:
            logger.warning("programmatic dependent launch unavailable (%s); plain launches", why)
    set_enabled(use)
    if use:
        logger.info("Triton kernels launch with programmatic dependent launch (PDL)")
    return use


__all__ = ["configure", "enabled", "gemv_prefetch", "launch_kwargs", "pdl_enter",
           "pdl_launch_dependents", "pdl_wait", "prefetch_l2", "set_enabled", "supported"]
