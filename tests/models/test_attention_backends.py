"""Backend selection and the Triton backend against the torch reference backend, on one
flat batch of every kind the engine builds (Triton runs in its interpreter on CPU)."""

import random

import pytest
import torch

from llmaccel.errors import LLMAccelError
from llmaccel.models.attention import AttentionMetadata, get_attention_backend
from llmaccel.models.attention.backend import TorchAttentionBackend, resolve_backend_name

pytest.importorskip("triton")


def test_auto_resolves_per_device_and_unknown_names_fail():
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("flex", "cpu") == "flex"
    with pytest.raises(LLMAccelError, match="unknown attention backend 'fast'.*auto"):
        get_attention_backend("fast")
    assert get_attention_backend("triton").supports_cuda_graphs
    assert not TorchAttentionBackend.supports_cuda_graphs


def _step(query_lens, seq_lens, heads=4, kv_heads=2, d=16, block_size=4, seed=0):
    """A step over a cache that already holds each sequence's earlier tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, q, n in zip(tables, query_lens, seq_lens) for p in range(n - q, n)]
    meta = AttentionMetadata.build(query_lens, seq_lens, "cpu", slots, tables)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    return q, k, v, cache, meta


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([5, 1, 9], [5, 1, 9]),          # plain prefill
    ([3, 1, 1, 6], [11, 8, 1, 6]),   # prefix hit, decodes, a fresh prompt: one mixed step
    ([1, 1, 1], [13, 1, 30]),        # decode only (split-K path)
])
def test_triton_backend_equals_torch_backend(query_lens, seq_lens):
    q, k, v, cache, meta = _step(query_lens, seq_lens)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0.25)
    got = get_attention_backend("triton").forward(q, k, v, tri_cache, meta, 0.25)
    torch.testing.assert_close(tri_cache, ref_cache)  # K/V written to the same slots
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_triton_backend_without_cache():
    q, k, v, _, _ = _step([4, 7], [4, 7])
    meta = AttentionMetadata.for_prefill([4, 7], "cpu")
    want = TorchAttentionBackend().forward(q, k, v, None, meta, 0.25)
    got = get_attention_backend("triton").forward(q, k, v, None, meta, 0.25)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
