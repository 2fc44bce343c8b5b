"""Rotary position embedding (rotate-half / NeoX layout, as HF checkpoints store q and k).

Supports rope_type default, linear and llama3 (Llama 3.1/3.2's frequency-dependent scaling).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """Rope settings from a transformers 5 config (`rope_parameters`) or an older one."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rope to flat q [T, heads, d] and k [T, kv_heads, d] at the given positions."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, params)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # fp32 cache, built once; a buffer so it follows the model to its device.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)
        self.use_triton = False  # set by TransformerForCausalLM.set_fused_kernels

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton:
            # In place on the q/k views of the qkv output: no new tensors, one launch each.
            from llmaccel.kernels.rotary import rotary_embedding
            return rotary_embedding(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
