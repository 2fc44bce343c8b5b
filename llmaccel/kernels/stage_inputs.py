"""A decode step's CUDA-graph inputs in one kernel launch (`csrc/stage_inputs.cu`).

`engine/cuda_graph.py` keeps a step's rows (ids, positions, slots, ..., context lengths,
block tables) in pinned host buffers and the graph reads static device buffers. Copying them
took three host-to-device copies plus a kernel for the async step's device-side ids, one
after another on the stream between two graphs; this kernel reads the pinned buffers through
their mapped device addresses and writes all of it at once. `StagedCopy.available` says
whether it can run (CUDA C kernels, pinned buffers); the caller copies with torch otherwise.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from llmaccel.kernels import cuda_rtc

_IDS_KIND = {torch.int64: 1, torch.float64: 2, torch.int32: 3}
THREADS = 256


@functools.lru_cache(maxsize=1)
def _source() -> str:
    return cuda_rtc.source_files("stage_inputs.cu")[0]


class StagedCopy:
    """Copies one pinned host set (inputs int64 [R, n], seq_lens int32 [n], tables int32
    [n, w]) into device buffers of the same shapes."""

    def __init__(self, host: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 device_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.host = host
        self.dev = device_bufs
        self._ptrs = [cuda_rtc.host_device_pointer(t) for t in host]
        self._bases: dict[int, int] = {}  # pinned allocation -> its mapped device address

    def _mapped(self, t: torch.Tensor) -> int:
        """The device address of pinned tensor `t` (a view anywhere in its allocation)."""
        base = t.untyped_storage().data_ptr()
        if base not in self._bases:
            whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            self._bases[base] = cuda_rtc.host_device_pointer(whole)
        return self._bases[base] + (t.data_ptr() - base)

    def copies_out(self, src: torch.Tensor, dst: torch.Tensor) -> bool:
        """Whether `__call__` can take copy_out=(src, dst)."""
        return (src.device == self.dev[0].device and src.dim() == 2 and src.shape[0] == 2
                and src.element_size() == 8 and src.stride(1) == 1 and not dst.is_cuda
                and dst.is_pinned() and dst.is_contiguous() and dst.shape == src.shape
                and dst.dtype == src.dtype)

    @staticmethod
    def available(host: tuple[torch.Tensor, ...], device: torch.device) -> bool:
        return (device.type == "cuda" and all(t.is_pinned() for t in host)
                and cuda_rtc.available(device))

    def __call__(self, bs: int, cols: int, ids: torch.Tensor | None = None,
                 copy_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Rows [:bs] of every input, the first `cols` entries of bs table rows, and
        inputs[0, :len(ids)] = ids (int64, float64 or int32 on the device; float64 ids are
        exact integers: greedy_with_logprobs' argmax). `copy_out` (src [2, m] 8-byte values
        on the device, last dim contiguous; dst: a pinned host tensor of its shape,
        contiguous): dst = src, written by the kernel (see `copies_out`)."""
        hin, hseq, htab = self.host
        din, dseq, dtab = self.dev
        rows, n = hin.shape
        w = htab.shape[1]
        if not (0 < bs <= n and 0 <= cols <= w):
            raise ValueError(f"stage_inputs: bs={bs} cols={cols} outside [1, {n}] x [0, {w}]")
        if ids is not None:
            if (ids.dtype not in _IDS_KIND or ids.dim() != 1 or not ids.is_contiguous()
                    or ids.numel() > bs or ids.device != din.device):
                raise ValueError(f"stage_inputs: ids must be a contiguous 1-d int64, float64 "
                                 f"or int32 tensor of at most {bs} on {din.device}")
        ptr = ctypes.c_void_p
        out_args = [ptr(0), ctypes.c_longlong(0), ptr(0), ctypes.c_int(0)]
        m = 0
        if copy_out is not None:
            src, dst = copy_out
            if not self.copies_out(src, dst):
                raise ValueError("stage_inputs: copy_out must be a [2, m] tensor of 8-byte "
                                 "values on the device and a pinned contiguous host tensor of "
                                 "its shape and dtype")
            m = src.shape[1]
            out_args = [ptr(src.data_ptr()), ctypes.c_longlong(src.stride(0)),
                        ptr(self._mapped(dst)), ctypes.c_int(m)]
        kern = cuda_rtc.get_kernel(_source(), "stage_inputs", din.device, {})
        total = max(rows * bs + bs + bs * cols, 2 * m)
        args = [ptr(self._ptrs[0]), ptr(self._ptrs[1]), ptr(self._ptrs[2]),
                ptr(din.data_ptr()), ptr(dseq.data_ptr()), ptr(dtab.data_ptr()),
                ctypes.c_int(n), ctypes.c_int(bs), ctypes.c_int(w), ctypes.c_int(cols),
                ctypes.c_int(rows), ptr(ids.data_ptr() if ids is not None else 0),
                ctypes.c_int(ids.numel() if ids is not None else 0),
                ctypes.c_int(_IDS_KIND[ids.dtype] if ids is not None else 0)] + out_args
        kern.launch(max(1, min(-(-total // THREADS), 64)), THREADS, args)
