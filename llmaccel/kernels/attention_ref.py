"""PyTorch references for paged attention: writing K/V into the cache and attending over it.

Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; slot s is
(block s // block_size, offset s % block_size). A slot of -1 is skipped (padding).

FP8 caches (torch.float8_e4m3fn) hold K / k_scale and V / v_scale with per-tensor scales:
store = clamp(x / scale, +-448) cast to e4m3, load = float(e4m3) * scale (vLLM's scheme; the
scales are 1.0 until calibrated ones are loaded). Other cache dtypes ignore the scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn; the plain cast turns larger values to NaN


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == getattr(torch, "float8_e4m3fn", None)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What a cache of `cache_dtype` stores for x. FP8 multiplies by 1 / scale in fp32, as the
    Triton kernel does (equal to x / scale whenever the scale is a power of two, 1.0 included),
    then saturates to +-448 before the round-to-nearest-even cast."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    inv = 1.0 / scale
    return (x.float() * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache entries -> `dtype`: float(e4m3) * scale for FP8, a plain cast otherwise."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def gather_cache(half: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """half [num_slots, kv_heads, d] (one of K/V, flat) -> half[slots]. FP8 is gathered as
    bytes: torch's indexing kernels do not cover float8 on every device and version."""
    if is_fp8(half.dtype):
        return half.view(torch.uint8)[slots].view(half.dtype)
    return half[slots]


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> None:
    """key/value [T, kv_heads, d] -> kv_cache at slot_mapping [T] (quantized for FP8)."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if is_fp8(kv_cache.dtype):  # scatter bytes (see gather_cache)
        flat = flat.view(torch.uint8)
        flat[0, slots] = quantize_kv(key[keep], kv_cache.dtype, k_scale).view(torch.uint8)
        flat[1, slots] = quantize_kv(value[keep], kv_cache.dtype, v_scale).view(torch.uint8)
        return
    flat[0, slots] = key[keep].to(kv_cache.dtype)
    flat[1, slots] = value[keep].to(kv_cache.dtype)


def gather_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..seq_len-1 of one sequence, from its block table."""
    pos = torch.arange(seq_len, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """One sequence: q [q_len, H, d] over k/v [kv_len, kv_heads, d]; the queries are the
    last q_len positions, so query j sees keys 0 .. kv_len - q_len + j."""
    q_len, kv_len = q.shape[0], k.shape[0]
    if q_len == kv_len:  # a whole prompt: is_causal (top-left aligned) is the same mask
        mask, causal = None, True
    else:  # bottom-right aligned (is_causal is top-left): an explicit mask
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
        causal = False
    # 4-D [1, heads, len, d]: SDPA's fused (flash) CPU kernel takes only batched inputs; 3-D
    # ones or an explicit causal mask send it to the unfused math path (8x slower at 2048).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1).to(q.dtype)[None],
        v.transpose(0, 1).to(q.dtype)[None], attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: list[int], seq_lens: list[int], scale: float,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Variable-length batch: q [T, H, d] flat; sequence i owns q rows
    query_start_loc[i]:query_start_loc[i+1] and seq_lens[i] cached positions."""
    block_size = kv_cache.shape[2]
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    fp8 = is_fp8(kv_cache.dtype)
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        slots = gather_slots(block_tables[i], seq_len, block_size)
        if fp8:
            k = dequantize_kv(gather_cache(flat[0], slots), q.dtype, k_scale)
            v = dequantize_kv(gather_cache(flat[1], slots), q.dtype, v_scale)
        else:
            k, v = flat[0, slots], flat[1, slots]
        out[start:end] = causal_attention_ref(q[start:end], k, v, scale)
    return out


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         query_start_loc: list[int], scale: float) -> torch.Tensor:
    """Prefill without a cache: each sequence attends causally to its own new tokens."""
    out = torch.empty_like(q)
    for start, end in zip(query_start_loc[:-1], query_start_loc[1:]):
        out[start:end] = causal_attention_ref(q[start:end], k[start:end], v[start:end], scale)
    return out


def paged_decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               k_scale: float = 1.0, v_scale: float = 1.0,
                               last_slots: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence, all sequences in one padded SDPA call: q [B, H, d],
    block_tables [B, max_blocks], seq_lens [B] -> [B, H, d]. Same math as
    `paged_attention_ref`, without its per-sequence Python loop. `last_slots` [B] (tree
    verification): row b's newest key (position seq_lens[b] - 1) comes from that cache slot
    where it is >= 0, not through the block table."""
    block_size = kv_cache.shape[2]
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].long()                        # [B, L]
    blocks = block_tables[:, pos // block_size].long().clamp_min(0)       # -1 pads -> block 0
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    if last_slots is not None:
        last = last_slots.long()
        newest = (pos[None, :] == seq_lens[:, None].long() - 1) & (last[:, None] >= 0)
        slots = torch.where(newest, last[:, None].expand_as(slots), slots)
    if is_fp8(kv_cache.dtype):
        k = dequantize_kv(gather_cache(flat[0], slots), q.dtype, k_scale)
        v = dequantize_kv(gather_cache(flat[1], slots), q.dtype, v_scale)
    else:
        k, v = flat[0, slots].to(q.dtype), flat[1, slots].to(q.dtype)    # [B, L, kv_heads, d]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :],
        scale=scale, enable_gqa=q.shape[1] != k.shape[2])
    return out.squeeze(2)
