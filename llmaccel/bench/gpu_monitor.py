"""GPU utilization and memory sampled through NVML while a benchmark runs (`nvidia-ml-py`,
the `gpu` extra). Without NVML or a GPU the monitor says so and reports nothing: a run on
a CPU must not print a GPU figure."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30


@dataclass
class GpuSamples:
    util_pct: list[float] = field(default_factory=list)
    mem_used_bytes: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """Metric name -> value (empty without samples)."""
        if not self.util_pct:
            return {}
        return {"gpu_util_pct_mean": sum(self.util_pct) / len(self.util_pct),
                "gpu_util_pct_max": max(self.util_pct),
                "gpu_mem_used_gib_max": max(self.mem_used_bytes) / GIB}


class GpuMonitor:
    """`with GpuMonitor(index) as mon: ...` then `mon.samples`. `nvml` may be injected (tests);
    by default `pynvml` from nvidia-ml-py. `unavailable` holds why nothing was sampled."""

    def __init__(self, index: int = 0, interval_s: float = 0.1, nvml: Any = None) -> None:
        self.index, self.interval_s = index, interval_s
        self.samples = GpuSamples()
        self.unavailable: str | None = None
        self._nvml = nvml
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None

    def __enter__(self) -> GpuMonitor:
        try:
            if self._nvml is None:
                import pynvml
                self._nvml = pynvml
            self._nvml.nvmlInit()
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception as e:  # no package, no driver, no GPU: say why, sample nothing
            self.unavailable = f"NVML unavailable ({type(e).__name__}: {e})"
            return self
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        self.samples.util_pct.append(float(util.gpu))
        self.samples.mem_used_bytes.append(int(mem.used))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception as e:  # a driver hiccup ends sampling, not the benchmark
                self.unavailable = f"NVML sampling stopped ({type(e).__name__}: {e})"
                return

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            try:
                self._sample()  # the last state counts too
            except Exception:
                pass
            self._nvml.nvmlShutdown()
