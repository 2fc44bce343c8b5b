"""Dequantization of llama.cpp's GGUF block formats in torch, a whole tensor at a time.

transformers reads GGUF weights through gguf-py, whose numpy dequantization walks a tensor
in small groups of rows: for Qwen2.5-Coder-1.5B's Q4_K_M file that is ~23 s of a ~100 s load
on a 2-core CPU (48,000 calls for its 169 Q4_K tensors), and loading a GGUF is what every
`LLM("model.gguf")` and a GGUF conversion do first. Here each format is a
handful of vectorized torch ops over all of a tensor's blocks (torch's ops run on every
core). `models/gguf_loading.py` puts this in gguf-py's place while transformers loads.

The block layouts are ggml's (public, `ggml-common.h`): QK_K = 256 weights per k-quant super
block, 32 per legacy block; scales are little-endian fp16. Every function takes the raw bytes
[rows, row_bytes] (uint8) and returns float32 [rows, weights_per_row], evaluated in float32
in the same operation order as gguf-py's reference, so the values are the same
(tests/models/test_gguf_blocks.py compares them bit for bit).
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256

# type name -> (weights per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 2 + 16),
    "Q4_1": (32, 2 + 2 + 16),
    "Q5_0": (32, 2 + 4 + 16),
    "Q8_0": (32, 2 + 32),
    "Q4_K": (QK_K, 2 + 2 + 12 + QK_K // 2),
    "Q5_K": (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    "Q6_K": (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, g, 32] bytes -> [n, g, 64]: each group's 32 low nibbles, then its 32 high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18].unsqueeze(1)).flatten(1).to(torch.float32) - 8.0
    return q * d


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20].unsqueeze(1)).flatten(1).to(torch.float32)
    return d * q + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    # 32 high bits, one per weight, little-endian: bit j is weight j's fifth bit
    qh = b[:, 2:6].to(torch.int32)
    bits = qh[:, :, None] >> torch.arange(8, dtype=torch.int32, device=b.device)
    high = (bits & 1).flatten(1).to(torch.uint8) << 4  # [n, 32]
    q = (_nibbles(b[:, 6:22].unsqueeze(1)).flatten(1) | high).to(torch.float32) - 16.0
    return q * d


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    return b[:, 2:34].contiguous().view(torch.int8).to(torch.float32) * d


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> ([n, 8], [n, 8]) uint8.
    Bytes 0-3: scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7: mins
    0-3 and the top bits of mins 4-7; bytes 8-11: the low 4 bits of scales 4-7 (low
    nibble) and of mins 4-7 (high nibble)."""
    a, m, lo = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 0x3F, (lo & 0x0F) | ((a >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (lo >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_scale_offset(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's first 16 bytes (d, dmin, packed scales) -> each sub-block's scale d * sc
    and offset dmin * m, [n, 8, 1] float32: weight = scale * q - offset."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return ((d * sc.to(torch.float32)).reshape(n, 8, 1),
            (dmin * mn.to(torch.float32)).reshape(n, 8, 1))


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, offset = _k_scale_offset(b)
    # 4 groups of 32 bytes: low nibbles are sub-block 2g, high nibbles 2g + 1
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).to(torch.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, offset = _k_scale_offset(b)
    qh = b[:, 16:48]  # [n, 32]: bit s of byte l is the fifth bit of weight l of sub-block s
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    high = ((qh.unsqueeze(1) >> shifts) & 1) << 4  # [n, 8, 32]
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = (low | high).to(torch.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)     # per half of 128 weights: 64 bytes of low bits
    qh = b[:, 128:192].reshape(n, 2, 32)   # 32 bytes of high bits (2 per weight, 4 groups)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # [n, 16]
    d = _f16(b[:, 208:210])
    # a half's 128 weights in 4 groups of 32: low nibbles of ql[0:32], of ql[32:64], then
    # their high nibbles; group g's high bits are bits 2g, 2g + 1 of qh
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-1).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = (qh.unsqueeze(2) >> shifts) & 0x03  # [n, 2, 4, 32]
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.float32)
    scale = (d * scales).reshape(n, 2, 4, 2, 1)  # one scale per 16 weights
    return (scale * q.reshape(n, 2, 4, 2, 16)).reshape(n, QK_K)


_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}

# weights per call: each op's temporaries (~40 bytes per weight in all) then stay in the CPU's
# caches; 4M weights dequantized Q4_K 6x faster than 32M on a 2-core CPU (1.35 against 7.9 s
# for 210 MB of Qwen2.5-1.5B's tensors), 64k too small (2.8 s: per-call overhead)
_CHUNK_WEIGHTS = 1 << 22


def supported(type_name: str) -> bool:
    return type_name in _DEQUANT


def dequantize(data: np.ndarray | torch.Tensor, type_name: str) -> torch.Tensor:
    """Raw GGUF bytes [..., row_bytes] (uint8) of format `type_name` -> float32
    [..., weights_per_row]."""
    if type_name not in _DEQUANT:
        raise ValueError(f"no torch dequantization for GGUF type {type_name}")
    per_block, nbytes = BLOCKS[type_name]
    if isinstance(data, np.ndarray):
        # gguf-py hands out read-only memory maps: torch wants a buffer it may write
        data = np.ascontiguousarray(data)
        raw = torch.from_numpy(data if data.flags.writeable else data.copy())
    else:
        raw = data
    if raw.dtype != torch.uint8 or raw.shape[-1] % nbytes:
        raise ValueError(f"{type_name} data must be uint8 rows of whole {nbytes}-byte blocks, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, nbytes)
    step = max(1, _CHUNK_WEIGHTS // per_block)
    out = torch.empty(blocks.shape[0], per_block, dtype=torch.float32, device=raw.device)
    fn = _DEQUANT[type_name]
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = fn(blocks[i:i + step])
    return out.reshape(*lead, raw.shape[-1] // nbytes * per_block)


__all__ = ["BLOCKS", "QK_K", "dequantize", "supported"]
