"""Per-GPU tuning tables for `kernels/gemm.py`, written by `benchmarks/tune_gemm.py`.

A table maps (bits, M bucket, N, K) to the fastest measured tile config and, for dense bf16/fp16
weights, to whether the Triton kernel beat cuBLAS at all (dense layers use cuBLAS unless the
table says otherwise: no measured win, no switch). Tables live in `kernels/configs/` named after
`torch.cuda.get_device_name()` (vLLM keeps its fused-MoE configs the same way), or in the file
named by LLMACCEL_GEMM_CONFIGS. Shapes missing from the table fall back to
`gemm.pick_config` for quantized weights and to cuBLAS for dense ones.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import torch

from llmaccel.kernels.gemm import GemmConfig, pick_config
from llmaccel.kernels.gemv_fp8 import GemvFp8Config, valid_config
from llmaccel import envs
from llmaccel.kernels.gemv_w4 import GemvW4Config, _valid_block_k

CONFIG_DIR = Path(__file__).parent / "configs"
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def m_bucket(m: int) -> int:
    """The smallest tuned batch size >= m (rows beyond the largest bucket use the largest)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def table_key(bits: int, m: int, n: int, k: int) -> str:
    return f"{bits}:{m_bucket(m)}:{n}:{k}"


def device_file_name(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        return {}
    return json.loads(p.read_text()).get("entries", {})


def table_path(device: torch.device | None = None) -> Path | None:
    if envs.LLMACCEL_GEMM_CONFIGS is not None:
        return envs.LLMACCEL_GEMM_CONFIGS
    if not torch.cuda.is_available():
        return None
    index = device.index if device is not None and device.index is not None else \
        torch.cuda.current_device()
    return CONFIG_DIR / device_file_name(_device_name(index))


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def lookup(bits: int, m: int, n: int, k: int,
           device: torch.device | None = None) -> tuple[str, GemmConfig] | None:
    """("triton" | "cublas", config) for the smallest tuned batch bucket >= m (the largest
    tuned one beyond it), or None when the table has no entry for (bits, N, K)."""
    path = table_path(device)
    return None if path is None else _lookup(str(path), bits, m_bucket(m), n, k)


@functools.lru_cache(maxsize=4096)
def _lookup(path: str, bits: int, bucket: int, n: int, k: int
            ) -> tuple[str, GemmConfig] | None:
    entries = _load(path)
    tuned = [b for b in M_BUCKETS if f"{bits}:{b}:{n}:{k}" in entries]
    if not tuned:
        return None
    b = next((t for t in tuned if t >= bucket), tuned[-1])
    entry = entries[f"{bits}:{b}:{n}:{k}"]
    return entry["backend"], GemmConfig(**entry["config"])


FUSED_KINDS = ("norm", "res", "silu")


def fused_key(kind: str, n: int, k: int) -> str:
    """The table key of a batch-1 fused decode GEMV (benchmarks/tune_fused_decode.py): kind
    "norm" (RMSNorm prologue), "res" (residual epilogue) or "silu" (SiLU-and-mul prologue and
    residual epilogue, the down projection)."""
    if kind not in FUSED_KINDS:
        raise ValueError(f"fused kind must be one of {FUSED_KINDS}, got {kind!r}")
    return f"16{kind}:1:{n}:{k}"


def fused_config(kind: str, m: int, n: int, k: int, device: torch.device | None = None
                 ) -> GemmConfig | None:
    """The tuned tile of a fused decode GEMV with m rows: for m == 1 the batch-1 fused entry,
    else the dense batch-1 entry's tile; None for more rows. Tiles tuned for other row counts
    are not borrowed: the 16-row dense tiles fused into 2-16-row decode layers ran the
    linear layers of a qwen2.5-1.5b step at 3.3-6.8 ms against 1.6 ms for one row and ~1.5 ms
    of cuBLAS at 32 rows (H100)."""
    path = table_path(device)
    if path is None or m != 1:
        return None
    entry = _load(str(path)).get(fused_key(kind, n, k))
    if entry is not None:
        return GemmConfig(**entry["config"])
    entry = _load(str(path)).get(table_key(16, 1, n, k))
    return GemmConfig(**entry["config"]) if entry is not None else None


def gemv_w4_config(n: int, k: int, group: int, device: torch.device | None = None
                   ) -> GemvW4Config | None:
    """The tuned tile of the batch-1 W4A16 GEMV (`kernels/gemv_w4.py`, entries "w4gemv:1:N:K"
    from benchmarks/bench_w4_gemv.py), or None when the table has none or it does not fit
    this group size (group -1: per channel)."""
    path = table_path(device)
    return None if path is None else _gemv_w4_lookup(str(path), n, k, group)


def gemv_w4_cuda_config(n: int, k: int, device: torch.device | None = None):
    """The tuned tile of the CUDA C batch-1 int4 GEMV (`kernels/gemv_w4_cuda.py`, entries
    "w4cuda:1:N:K" from `benchmarks/bench_w4_cuda_gemv.py --out-table`), or None when the table has
    none or it does not fit K."""
    path = table_path(device)
    return None if path is None else _gemv_w4_cuda_lookup(str(path), n, k)


@functools.lru_cache(maxsize=4096)
def _gemv_w4_cuda_lookup(path: str, n: int, k: int):
    from llmaccel.kernels.gemv_w4_cuda import CudaGemvW4Config

    entry = _load(path).get(f"w4cuda:1:{n}:{k}")
    if entry is None:
        return None
    cfg = CudaGemvW4Config(**entry["config"])
    return cfg if cfg.fits(k) else None


@functools.lru_cache(maxsize=4096)
def _gemv_w4_lookup(path: str, n: int, k: int, group: int) -> GemvW4Config | None:
    entry = _load(path).get(f"w4gemv:1:{n}:{k}")
    if entry is None:
        return None
    cfg = GemvW4Config(**entry["config"])
    return cfg if _valid_block_k(cfg.block_k, k, k if group == -1 else group) else None


QUANT_FUSED_PREFIXES = ("w4", "fp8")


def fused_quant_key(prefix: str, kind: str, n: int, k: int) -> str:
    """The table key of a batch-1 fused decode GEMV on quantized weights
    (benchmarks/tune_fused_decode_quant.py): prefix "w4" (kernels/gemv_w4.py) or "fp8"
    (kernels/gemv_fp8.py); kinds as in `fused_key`."""
    if kind not in FUSED_KINDS:
        raise ValueError(f"fused kind must be one of {FUSED_KINDS}, got {kind!r}")
    if prefix not in QUANT_FUSED_PREFIXES:
        raise ValueError(f"prefix must be one of {QUANT_FUSED_PREFIXES}, got {prefix!r}")
    return f"{prefix}{kind}:1:{n}:{k}"


def _fused_quant_entry(prefix: str, kind: str, n: int, k: int,
                       device: torch.device | None) -> dict | None:
    path = table_path(device)
    return None if path is None else _load(str(path)).get(fused_quant_key(prefix, kind, n, k))


def fused_w4_config(kind: str, n: int, k: int, group: int,
                    device: torch.device | None = None) -> GemvW4Config | None:
    """The tile of an int4 fused decode GEMV, or None. Only a table entry counts: the tuner
    writes one only where the fused chain beat the unfused one (on an H100 it did not: the
    prologue's per-input work made the int4 GEMVs instruction-bound, see
    docs/performance.md); a tile that does not fit the
    group size counts as none."""
    entry = _fused_quant_entry("w4", kind, n, k, device)
    if entry is None:
        return None
    cfg = GemvW4Config(**entry["config"])
    return cfg if _valid_block_k(cfg.block_k, k, k if group == -1 else group) else None


def fused_fp8_config(kind: str, n: int, k: int, device: torch.device | None = None
                     ) -> GemvFp8Config | None:
    """The tile of an FP8 fused decode GEMV, or None (as `fused_w4_config`: only where the
    tuner measured the fused chain faster)."""
    entry = _fused_quant_entry("fp8", kind, n, k, device)
    if entry is None:
        return None
    cfg = GemvFp8Config(**entry["config"])
    return cfg if valid_config(cfg) else None


def gemv_fp8_config(n: int, k: int, device: torch.device | None = None
                    ) -> GemvFp8Config | None:
    """The tuned tile of the batch-1 FP8 W8A8 GEMV (`kernels/gemv_fp8.py`, entries
    "fp8gemv:1:N:K" from benchmarks/bench_fp8_gemv.py, written only where it beat
    `torch._scaled_mm`), or None when the table has none (or an unusable one)."""
    path = table_path(device)
    return None if path is None else _gemv_fp8_lookup(str(path), n, k)


@functools.lru_cache(maxsize=4096)
def _gemv_fp8_lookup(path: str, n: int, k: int) -> GemvFp8Config | None:
    entry = _load(path).get(f"fp8gemv:1:{n}:{k}")
    if entry is None:
        return None
    cfg = GemvFp8Config(**entry["config"])
    return cfg if valid_config(cfg) else None


def dense_config(m: int, n: int, k: int, device: torch.device | None = None
                 ) -> GemmConfig | None:
    """The Triton config for a dense product where the table measured it faster than cuBLAS
    for this bucket of rows, else None (use cuBLAS). Unlike the packed kernels (which have no
    cuBLAS to fall back on), no tile is borrowed from another bucket (see `fused_config`)."""
    path = table_path(device)
    if path is None:
        return None
    entry = _load(str(path)).get(table_key(16, m, n, k))
    if entry is None or entry["backend"] != "triton":
        return None
    return GemmConfig(**entry["config"])


def packed_config(m: int, n: int, k: int, bits: int, group: int,
                  device: torch.device | None = None) -> GemmConfig:
    hit = lookup(bits, m, n, k, device)
    return hit[1] if hit is not None else pick_config(m, n, k, bits, group)


def write_table(out: str, device_name: str, entries: dict[str, Any],
                **header: Any) -> Path:
    """Merge `entries` into the tuning table `out` ("auto": this GPU's file in configs/),
    keeping the entries this run did not tune; `header` keys replace the table's. Returns
    the path written (the tuning scripts' shared writer)."""
    path = CONFIG_DIR / device_file_name(device_name) if out == "auto" else Path(out)
    table = json.loads(path.read_text()) if path.is_file() else {}
    table.update({"device": device_name, "file": device_file_name(device_name), **header})
    table["entries"] = {**table.get("entries", {}), **entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    clear_cache()
    return path


def clear_cache() -> None:
    _load.cache_clear()
    _lookup.cache_clear()
    _gemv_w4_lookup.cache_clear()
    _gemv_w4_cuda_lookup.cache_clear()
    _gemv_fp8_lookup.cache_clear()
