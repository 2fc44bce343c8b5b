"""Driver-API calls of the CUDA C kernels from any thread: the driver acts on the calling
thread's current context, and a thread that made no CUDA runtime call has none. Checked against
a fake driver (no GPU): every launch, attribute call and host-pointer query makes the kernel's
context current first, in a fresh thread and in a thread where another context is current."""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace

import pytest

from llmaccel.kernels import cuda_rtc

CTX, OTHER = 0x1000, 0x2000


class FakeDriver:
    """Records (thread, call, current context) and fails a launch without the right context,
    as libcuda does ("invalid device context", CUDA_ERROR_INVALID_CONTEXT = 201)."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.calls: list[tuple[str, str, int]] = []

    def _current(self) -> int:
        return getattr(self.local, "ctx", 0)

    def _log(self, name: str) -> None:
        self.calls.append((threading.current_thread().name, name, self._current()))

    def cuCtxGetCurrent(self, out) -> int:
        out._obj.value = self._current() or None
        return 0

    def cuCtxSetCurrent(self, ctx) -> int:
        self.local.ctx = ctx.value or 0
        self._log("cuCtxSetCurrent")
        return 0

    def _needs_context(self, name: str) -> int:
        self._log(name)
        return 0 if self._current() == CTX else 201

    def cuLaunchKernelEx(self, cfg, func, params, extra) -> int:
        return self._needs_context("cuLaunchKernelEx")

    def cuFuncSetAttribute(self, func, attr, value) -> int:
        return self._needs_context("cuFuncSetAttribute")

    def cuFuncGetAttribute(self, out, attr, func) -> int:
        return self._needs_context("cuFuncGetAttribute")

    def cuMemHostGetDevicePointer_v2(self, out, ptr, flags) -> int:
        return self._needs_context("cuMemHostGetDevicePointer")

    def cuGetErrorString(self, code, out) -> int:
        return 1


@pytest.fixture
def driver(monkeypatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(cuda_rtc, "_libs", lambda: (None, fake))
    return fake


def _kernel() -> cuda_rtc.CudaKernel:
    """A loaded kernel as __init__ leaves it (its construction needs a GPU)."""
    k = cuda_rtc.CudaKernel.__new__(cuda_rtc.CudaKernel)
    k._ctx, k._func, k.name, k.device = CTX, ctypes.c_void_p(7), "stage_inputs", None
    k._pdl_attr, k._dynamic_shared = cuda_rtc._LaunchAttribute(), 48 * 1024
    return k


def _in_thread(fn) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    t = threading.Thread(target=run, name="engine")
    t.start()
    t.join()
    if errors:
        raise errors[0]


def test_a_launch_from_a_fresh_thread_makes_the_context_current_first(driver):
    k = _kernel()
    stream = SimpleNamespace(cuda_stream=0)
    _in_thread(lambda: [k.launch(1, 32, [ctypes.c_int(1)], stream=stream) for _ in range(3)])
    names = [name for _, name, _ in driver.calls]
    # once per thread, then every launch finds it current
    assert names == ["cuCtxSetCurrent", "cuLaunchKernelEx", "cuLaunchKernelEx",
                     "cuLaunchKernelEx"]
    assert all(ctx == CTX for _, name, ctx in driver.calls if name == "cuLaunchKernelEx")


def test_another_current_context_is_replaced_before_each_driver_call(driver):
    k = _kernel()
    stream = SimpleNamespace(cuda_stream=0)

    def steps() -> None:
        for _ in range(2):
            driver.local.ctx = OTHER  # e.g. a library switched devices in this thread
            k.launch(1, 32, [ctypes.c_int(1)], stream=stream, shared_mem=64 * 1024)
            driver.local.ctx = OTHER
            k.num_regs()

    _in_thread(steps)
    driver_calls = [(name, ctx) for _, name, ctx in driver.calls if name != "cuCtxSetCurrent"]
    assert driver_calls and all(ctx == CTX for _, ctx in driver_calls)


def test_without_the_context_the_fake_driver_refuses(driver):
    """Control: the fake fails a launch made with no current context, as libcuda does."""
    _, cuda = cuda_rtc._libs()
    with pytest.raises(cuda_rtc.CudaRtcError, match="cuLaunchKernelEx"):
        cuda_rtc._check_cu(cuda, cuda.cuLaunchKernelEx(None, None, None, None),
                           "cuLaunchKernelEx(stage_inputs)")
