"""PyTorch references for paged attention: writing K/V into the cache and attending over it.

Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; slot s is
(block s // block_size, offset s % block_size). A slot of -1 is skipped (padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """key/value [T, kv_heads, d] -> kv_cache at slot_mapping [T]."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
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
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: list[int], seq_lens: list[int],
                        scale: float) -> torch.Tensor:
    """Variable-length batch: q [T, H, d] flat; sequence i owns q rows
    query_start_loc[i]:query_start_loc[i+1] and seq_lens[i] cached positions."""
    block_size = kv_cache.shape[2]
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        slots = gather_slots(block_tables[i], seq_len, block_size)
        out[start:end] = causal_attention_ref(q[start:end], flat[0, slots], flat[1, slots], scale)
    return out


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         query_start_loc: list[int], scale: float) -> torch.Tensor:
    """Prefill without a cache: each sequence attends causally to its own new tokens."""
    out = torch.empty_like(q)
    for start, end in zip(query_start_loc[:-1], query_start_loc[1:]):
        out[start:end] = causal_attention_ref(q[start:end], k[start:end], v[start:end], scale)
    return out


def paged_decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """One new token per sequence, all sequences in one padded SDPA call: q [B, H, d],
    block_tables [B, max_blocks], seq_lens [B] -> [B, H, d]. Same math as
    `paged_attention_ref`, without its per-sequence Python loop."""
    block_size = kv_cache.shape[2]
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].long()                        # [B, L]
    blocks = block_tables[:, pos // block_size].long().clamp_min(0)       # -1 pads -> block 0
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    k, v = flat[0, slots].to(q.dtype), flat[1, slots].to(q.dtype)        # [B, L, kv_heads, d]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :],
        scale=scale, enable_gqa=q.shape[1] != k.shape[2])
    return out.squeeze(2)
