"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A batch-1 decode step is ~100-180 small kernels. Even inside a CUDA graph each kernel boundary
costs a few microseconds: the next kernel's programs are only scheduled once the previous grid
has drained, and then wait for their first loads from device memory. With PDL (compute
capability 9.0+, Hopper) a kernel is launched while its predecessor still runs; it may do work
that depends on nothing the predecessor writes (a GEMV streams its read-only weights) and then
waits at `griddepcontrol.wait` until the predecessor has finished and its writes are visible.

The rule every PDL kernel here keeps (and the reason it is safe to chain them): it calls
`gdc_wait()` before it reads anything another kernel of the step writes, and before it writes
anything at all; it calls `gdc_launch_dependents()` only after that wait. A kernel can therefore
run at most one kernel ahead, and waiting on the previous kernel transitively waits on all
earlier ones. Kernels launched without PDL (torch's) serialize as usual.

It follows that when a kernel starts, the kernel two launches back has finished: the one
before it released it only after its own wait. So data written two or more launches back may
be read before the wait. The decode attention kernel reads the step's staged inputs (context
lengths, block tables) that way; they are written before the first layer's kernels. In a CUDA
graph decode step it also reads its first tile's K/V at positions earlier steps wrote (below
the step input `kv_fresh_from`); only the new tokens' K/V come from the kernel just before it.

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

from llmaccel import envs

logger = logging.getLogger(__name__)

PDL_MIN_CAPABILITY = (9, 0)
# Whether PDL is on (where supported) when neither the caller nor LLMACCEL_PDL says: set from
# measurement (graph replay -3% on an H100, docs/performance.md).
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


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The prologue of a kernel with nothing to prefetch: wait, then release the next one."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)


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
    `requested` None: LLMACCEL_PDL if set, else the default (on). Returns the decision."""
    if requested is None:
        requested = envs.LLMACCEL_PDL
        requested = DEFAULT_ON if requested is None else requested
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


__all__ = ["configure", "enabled", "launch_kwargs", "pdl_enter", "pdl_launch_dependents",
           "pdl_wait", "set_enabled", "supported"]
