"""Device facts every layer may need: a device's name for records and logs, and giving cached
GPU memory back between models."""

from __future__ import annotations

import gc
import platform

import torch


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def release_memory() -> None:
    """Drop cached GPU memory between models: the next one sizes its KV pool from what is
    free, and a peak left over from the previous one must not count against it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
