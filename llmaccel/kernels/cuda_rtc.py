"""CUDA C kernels compiled at run time with NVRTC and launched through the driver API.

Triton covers most of our kernels. Where a kernel needs control Triton does not give (which
registers hold what, and issuing every weight load of a thread before the programmatic
dependent launch wait, as `kernels/gemv_w4_cuda.py` does), we write it in CUDA C and compile
it here, in the same spirit as Triton's JIT: no nvcc and no build step, only the NVRTC library
that CUDA builds of PyTorch ship (`nvidia-cuda-nvrtc`) or a CUDA toolkit provides, and the
driver (libcuda). Sources include no headers, so NVRTC needs no include paths.

A `CudaKernel` is one compiled function of one source with one set of `-D` macros, loaded in
the current device's primary context. `launch` places it on a torch stream, optionally with
programmatic dependent launch (the attribute the Triton kernels get from `launch_pdl=True`),
and works under CUDA graph capture. Compile before capturing (the engine's warm-up does).

`available()` says whether both libraries load and the GPU is NVIDIA compute capability
>= 8.0 (bf16 conversions in PTX); callers fall back to Triton when it is False, and
LLMACCEL_CUDA_KERNELS=0 forces that.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import threading
from pathlib import Path

import torch

from llmaccel import envs

logger = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 0)
# CUlaunchAttributeID CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
# CUfunction_attribute CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (cuda.h)
_ATTR_MAX_DYNAMIC_SHARED = 8


class CudaRtcError(RuntimeError):
    """NVRTC or the driver refused: the message names the call and the library's reason."""


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an enum id padded to 8 bytes, then a 64-byte value union.
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be: the loader's path, CUDA wheels beside torch, a toolkit."""
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    site = Path(torch.__file__).resolve().parent.parent
    found = []
    for pattern in (f"{site}/nvidia/*/lib/libnvrtc.so*", "/usr/local/cuda/lib64/libnvrtc.so*",
                    "/usr/local/cuda-*/lib64/libnvrtc.so*"):
        found += sorted(p for p in glob.glob(pattern) if "builtins" not in p and "alt" not in p)
    # torch's own CUDA major first (a newer NVRTC can emit code an older driver refuses)
    return names + sorted(found, key=lambda p: f".so.{major}" not in p)


@functools.lru_cache(maxsize=1)
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(libnvrtc, libcuda), loaded once; OSError when either is missing."""
    nvrtc = None
    for name in _nvrtc_candidates():
        try:
            nvrtc = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if nvrtc is None:
        raise OSError("NVRTC (libnvrtc) not found: install PyTorch's CUDA build or a CUDA "
                      "toolkit")
    cuda = ctypes.CDLL("libcuda.so.1")
    return nvrtc, cuda


def available(device: torch.device | str | None = None) -> bool:
    """CUDA C kernels can be compiled and launched on `device` (default: the current one)."""
    if not envs.LLMACCEL_CUDA_KERNELS or torch.version.cuda is None:
        return False
    if not torch.cuda.is_available():
        return False
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        return False
    try:
        _libs()
    except OSError as e:
        logger.info("CUDA C kernels unavailable (%s); Triton kernels instead", e)
        return False
    return _probe(device.index if device.index is not None else torch.cuda.current_device())


_PROBE = 'extern "C" __global__ void probe(int* p) { if (threadIdx.x == 0) p[0] += 1; }'


@functools.lru_cache(maxsize=None)
def _probe(index: int) -> bool:
    """Compile, load and run a one-line kernel once per device (like pdl's probe): an NVRTC
    whose code the driver refuses, or a driver without cuLaunchKernelEx, turns the CUDA C
    kernels off with a warning instead of failing the first layer. Under graph capture the
    run (a synchronization) is skipped: compiling and loading are checked."""
    device = torch.device("cuda", index)
    try:
        kernel = get_kernel(_PROBE, "probe", device, {})
        if not torch.cuda.is_current_stream_capturing():
            x = torch.zeros(1, dtype=torch.int32, device=device)
            kernel.launch(1, 32, [ctypes.c_void_p(x.data_ptr())])
            if int(x.item()) != 1:
                raise CudaRtcError("the probe kernel computed a wrong value")
        return True
    except (CudaRtcError, OSError, AttributeError) as e:
        logger.warning("CUDA C kernels unavailable on cuda:%d (%s); Triton kernels instead",
                       index, e)
        return False


def _check_cu(cuda: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        cuda.cuGetErrorString(result, ctypes.byref(msg))
        raise CudaRtcError(f"{what} failed: {msg.value.decode() if msg.value else result}")


def _check_rtc(nvrtc: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CudaRtcError(f"{what} failed: {nvrtc.nvrtcGetErrorString(result).decode()}")


def compile_cubin(source: str, name: str, arch: str, defines: dict[str, int | str],
                  headers: dict[str, str] | None = None) -> bytes:
    """NVRTC: `source` -> a cubin for `arch` (e.g. "sm_90"), with -D`defines`; `headers` are
    the files it may #include by name (given from memory, no include path)."""
    return _compile(source, name, arch, defines, headers, "CUBIN")


def compile_ptx(source: str, name: str, arch: str, defines: dict[str, int | str],
                headers: dict[str, str] | None = None) -> str:
    """As `compile_cubin`, but the PTX for the virtual architecture of `arch` (sm_90 ->
    compute_90): for tests that look for an instruction."""
    return _compile(source, name, arch.replace("sm_", "compute_"), defines, headers,
                    "PTX").rstrip(b"\0").decode()


def _compile(source: str, name: str, arch: str, defines: dict[str, int | str],
             headers: dict[str, str] | None, output: str) -> bytes:
    nvrtc, _ = _libs()
    prog = ctypes.c_void_p()
    headers = headers or {}
    texts = (ctypes.c_char_p * len(headers))(*[t.encode() for t in headers.values()])
    names = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
    _check_rtc(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(),
                                               f"{name}.cu".encode(), len(headers),
                                               texts if headers else None,
                                               names if headers else None),
               "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device"]
        opts += [f"-D{k}={v}" for k, v in sorted(defines.items())]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
        if res != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise CudaRtcError(f"NVRTC could not compile {name} {defines}:\n"
                               f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        get_size, get = f"nvrtcGet{output}Size", f"nvrtcGet{output}"
        _check_rtc(nvrtc, getattr(nvrtc, get_size)(prog, ctypes.byref(size)), get_size)
        out = ctypes.create_string_buffer(size.value)
        _check_rtc(nvrtc, getattr(nvrtc, get)(prog, out), get)
        return out.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.lru_cache(maxsize=None)
def primary_context(index: int) -> int:
    """The primary context of device `index` (the one PyTorch's runtime calls use), retained
    once per process."""
    _, cuda = _libs()
    _check_cu(cuda, cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check_cu(cuda, cuda.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _check_cu(cuda, cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
              "cuDevicePrimaryCtxRetain")
    return int(ctx.value or 0)


def make_current(cuda: ctypes.CDLL, ctx: int) -> None:
    """Make `ctx` the calling thread's current context. Driver-API calls act on that context
    alone, and a thread that has not yet made a CUDA runtime call (an engine or server thread
    stepping the engine) has none: a launch there fails with "invalid device context"."""
    current = ctypes.c_void_p()
    _check_cu(cuda, cuda.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if (current.value or 0) != ctx:
        _check_cu(cuda, cuda.cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")


class CudaKernel:
    """One compiled kernel in the current context of `device`."""

    def __init__(self, cubin: bytes, func_name: str, device: torch.device) -> None:
        _, cuda = _libs()
        torch.cuda.init()
        with torch.cuda.device(device):
            self._ctx = primary_context(device.index or 0)
            make_current(cuda, self._ctx)
            self._module = ctypes.c_void_p()
            self._cubin = cubin  # the driver reads the image during the call only
            _check_cu(cuda, cuda.cuModuleLoadData(ctypes.byref(self._module), cubin),
                      "cuModuleLoadData")
            self._func = ctypes.c_void_p()
            _check_cu(cuda, cuda.cuModuleGetFunction(ctypes.byref(self._func), self._module,
                                                     func_name.encode()), "cuModuleGetFunction")
        self.name = func_name
        self.device = device
        attr = _LaunchAttribute()
        attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset,
                       ctypes.byref(ctypes.c_int(1)), ctypes.sizeof(ctypes.c_int))
        self._pdl_attr = attr
        self._dynamic_shared = 48 * 1024

    def num_regs(self) -> int:
        """Registers per thread (CU_FUNC_ATTRIBUTE_NUM_REGS), for logs and experiments."""
        _, cuda = _libs()
        make_current(cuda, self._ctx)
        v = ctypes.c_int()
        _check_cu(cuda, cuda.cuFuncGetAttribute(ctypes.byref(v), 4, self._func),
                  "cuFuncGetAttribute")
        return v.value

    def set_dynamic_shared(self, nbytes: int) -> None:
        """Allow `nbytes` of dynamic shared memory per block (above the 48 KiB every kernel
        may take, the driver wants the function's attribute raised first); once per size."""
        if nbytes <= self._dynamic_shared:
            return
        _, cuda = _libs()
        make_current(cuda, self._ctx)
        _check_cu(cuda, cuda.cuFuncSetAttribute(self._func, _ATTR_MAX_DYNAMIC_SHARED,
                                                ctypes.c_int(nbytes)),
                  f"cuFuncSetAttribute({self.name}, {nbytes} bytes of shared memory)")
        self._dynamic_shared = nbytes

    def launch(self, grid: int, block: int, args: list, stream: torch.cuda.Stream | None = None,
               pdl: bool = False, shared_mem: int = 0) -> None:
        """Run on `stream` (default: torch's current one). `args` are ctypes values in the
        kernel's parameter order (pointers as ctypes.c_void_p(tensor.data_ptr()));
        `shared_mem`: bytes of dynamic shared memory (`extern __shared__`)."""
        _, cuda = _libs()
        make_current(cuda, self._ctx)  # the engine may step from any thread
        if shared_mem > 48 * 1024:
            self.set_dynamic_shared(shared_mem)
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        cfg = _LaunchConfig(grid, 1, 1, block, 1, 1, shared_mem, ctypes.c_void_p(s.cuda_stream),
                            ctypes.pointer(self._pdl_attr) if pdl else None, 1 if pdl else 0)
        _check_cu(cuda, cuda.cuLaunchKernelEx(ctypes.byref(cfg), self._func, params, None),
                  f"cuLaunchKernelEx({self.name})")


_lock = threading.Lock()
_cache: dict[tuple, CudaKernel] = {}


def get_kernel(source: str, func_name: str, device: torch.device,
               defines: dict[str, int | str], headers: dict[str, str] | None = None,
               arch_suffix: str = "") -> CudaKernel:
    """The kernel compiled for `device`'s architecture with `defines` (and the #include-able
    `headers`), compiled once per process (about a second each). `arch_suffix` "a" targets
    the architecture-specific features (sm_90a: wgmma), which run on that GPU only."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (hash(source), func_name, device.index, tuple(sorted(defines.items())),
           tuple(sorted((headers or {}).items())), arch_suffix)
    with _lock:
        k = _cache.get(key)
        if k is None:
            major, minor = torch.cuda.get_device_capability(device)
            cubin = compile_cubin(source, func_name, f"sm_{major}{minor}{arch_suffix}", defines,
                                  headers)
            k = _cache[key] = CudaKernel(cubin, func_name, device)
        return k


def host_device_pointer(t: torch.Tensor) -> int:
    """The device address of pinned host tensor `t`'s data (cuMemHostGetDevicePointer): a
    kernel reads and writes page-locked host memory through it."""
    if t.is_cuda or not t.is_pinned():
        raise ValueError("host_device_pointer needs a pinned host tensor")
    _, cuda = _libs()
    make_current(cuda, primary_context(torch.cuda.current_device()))
    ptr = ctypes.c_uint64()
    _check_cu(cuda, cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(ptr),
                                                      ctypes.c_void_p(t.data_ptr()), 0),
              "cuMemHostGetDevicePointer")
    return ptr.value


def source_files(*names: str) -> tuple[str, dict[str, str]]:
    """(kernels/csrc/<names[0]>, {name: text} of the others): a kernel source and the
    headers it includes, read from the installed package."""
    from importlib import resources

    root = resources.files("llmaccel.kernels").joinpath("csrc")
    return (root.joinpath(names[0]).read_text(),
            {n: root.joinpath(n).read_text() for n in names[1:]})


__all__ = ["CudaKernel", "CudaRtcError", "available", "compile_cubin", "compile_ptx",
           "get_kernel", "host_device_pointer", "source_files"]
