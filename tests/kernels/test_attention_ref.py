"""The batched decode reference equals the per-sequence paged reference."""

import random

import torch

from llmaccel.kernels.attention_ref import (paged_attention_ref, paged_decode_attention_ref,
                                            reshape_and_cache_ref)


def test_batched_decode_equals_per_sequence_reference():
    rng = random.Random(0)
    block_size, num_blocks, kv_heads, heads, d = 4, 40, 2, 6, 8
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, d)
    lens = [1, 7, 12, 4, 9]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    for table, n in zip(tables, lens):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(n)])
        reshape_and_cache_ref(torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d), cache,
                              slots)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, d)
    want = paged_attention_ref(q, cache, bt, list(range(len(lens) + 1)), lens, 0.3)
    got = paged_decode_attention_ref(q, cache, bt, torch.tensor(lens, dtype=torch.int32), 0.3)
    torch.testing.assert_close(got, want)
