"""The machine side of a speed claim: which device, how fast it can move bytes, how many bytes
a decode step must move, and what share of the device's bandwidth a measured rate achieves.

Batch-1 decode is memory-bound: every step reads every weight once (and the KV cache of the
batch), so bytes per step x steps per second is the bandwidth the model achieved. Its ceiling
is the device-to-device copy bandwidth measured here (read + write), not the datasheet figure.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from llmaccel.analyze import kv_bytes_per_token as _kv_bytes_per_token
from llmaccel.device import device_name, release_memory  # noqa: F401 - part of this API




# `llmaccel bench --device` (and a recipe's `device:`) sets this for the whole command: the
# HF baselines, the copy-bandwidth roofline and the records' device name all follow it.
_chosen: str | None = None


def use_device(device: str | None) -> None:
    """Measure on `device` (cpu, cuda, cuda:1) from now on; None: a GPU when there is one."""
    global _chosen
    if device is not None:
        d = torch.device(device)  # raises on a malformed name
        if d.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA GPU on this machine")
        if d.type not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}: cpu or cuda[:N]")
    _chosen = device


def default_device() -> torch.device:
    if _chosen is not None:
        return torch.device(_chosen)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)




def free_memory_gib(device: torch.device | str) -> float | None:
    """Free GPU memory as the driver reports it (None on CPU): what the next KV pool is sized
    from, so a backend that left memory behind shows up here."""
    device = torch.device(device)
    return torch.cuda.mem_get_info(device)[0] / 2**30 if device.type == "cuda" else None


@dataclass(frozen=True)
class CopyBandwidth:
    gbps: float    # 10^9 bytes/s, bytes read + bytes written
    nbytes: int    # size of one copy
    repeats: int
    method: str    # how it was measured (CPU figures are labelled as such)


def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 2**30, repeats: int = 10,
                           copies_per_repeat: int = 4) -> CopyBandwidth:
    """Median device-to-device copy bandwidth over `repeats`, counting each copy as `nbytes`
    read plus `nbytes` written. Timed with CUDA events on GPU; on CPU a memcpy measured with
    the host clock (labelled: it is not a GPU figure)."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):  # first touches allocate pages / warm the copy engine
        dst.copy_(src)
    synchronize(device)
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(copies_per_repeat):
                dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3 / copies_per_repeat)
        else:
            t0 = time.perf_counter()
            for _ in range(copies_per_repeat):
                dst.copy_(src)
            seconds.append((time.perf_counter() - t0) / copies_per_repeat)
    del src, dst
    method = ("cuda d2d copy_, CUDA events" if device.type == "cuda"
              else "cpu memcpy (tensor copy_, host clock)")
    return CopyBandwidth(2 * nbytes / statistics.median(seconds) / 1e9, nbytes, repeats, method)


def weight_bytes(model: torch.nn.Module, include_untied_input_embedding: bool = False) -> int:
    """Bytes of weights one decode step reads. Parameters shared between modules count once,
    so a tied embedding is counted once, and counted: the LM head reads all of it every step.
    An untied input embedding is left out by default, as `llmaccel analyze` does: a step only
    looks up one row of it per token. Works on meta-device models (sizes only)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied or include_untied_input_embedding:
        return total
    embedding = _input_embedding(model)
    return total - embedding.numel() * embedding.element_size() if embedding is not None \
        else total


def _input_embedding(model: torch.nn.Module) -> torch.Tensor | None:
    get = getattr(model, "get_input_embeddings", None)  # HF models
    if callable(get):
        return get().weight
    inner = getattr(model, "model", None)  # ours: TransformerForCausalLM.model.embed_tokens
    embed = getattr(inner, "embed_tokens", None)
    return getattr(embed, "weight", None)


def kv_bytes_per_token(hf_config: PretrainedConfig, dtype: torch.dtype) -> int:
    """K and V of every layer for one token."""
    return int(_kv_bytes_per_token(hf_config, dtype.itemsize))


def bytes_per_decode_step(weights: float, kv_per_token: float = 0.0,
                          kv_tokens: float = 0.0) -> float:
    """Weights plus the KV cache read by the step: `kv_tokens` is the total context of the
    batch (for batch 1 with a growing context, its mean over the decode)."""
    return weights + kv_per_token * kv_tokens


def achieved_gbps(bytes_per_step: float, steps_per_s: float) -> float:
    return bytes_per_step * steps_per_s / 1e9


def pct_roofline(gbps: float, copy_gbps: float) -> float:
    return 100.0 * gbps / copy_gbps


def roofline_tok_s(copy_gbps: float, bytes_per_step: float, batch: int = 1) -> float:
    """The memory-bound ceiling: steps/s the bandwidth allows, times tokens per step."""
    return copy_gbps * 1e9 / bytes_per_step * batch


def decode_roofline(module: torch.nn.Module, hf_config: PretrainedConfig, dtype: torch.dtype,
                    kv_tokens: float, tok_s: float, copy: CopyBandwidth,
                    batch: int = 1) -> dict[str, Any]:
    """Achieved bandwidth of decode at `tok_s` (tokens of the whole batch per second): the
    module's weights plus `kv_tokens` of KV cache read per step. Returns gbps, pct_roofline
    and the inputs of the arithmetic, for a record's config."""
    weights = weight_bytes(module)
    kv_tok = kv_bytes_per_token(hf_config, dtype)
    per_step = bytes_per_decode_step(weights, kv_tok, kv_tokens)
    gbps = achieved_gbps(per_step, tok_s / batch)
    return {"gbps": gbps, "pct_roofline": pct_roofline(gbps, copy.gbps),
            "config": {"weight_bytes": weights, "kv_bytes_per_token": kv_tok,
                       "kv_tokens_per_step": kv_tokens, "bytes_per_step": per_step,
                       "copy_gbps": round(copy.gbps, 1), "copy_method": copy.method,
                       "copy_nbytes": copy.nbytes,
                       "roofline_tok_s": round(roofline_tok_s(copy.gbps, per_step, batch), 1),
                       "rate_basis": "tok_s (median, prefill included)"}}
