"""The FlexAttention backend equals the plain-PyTorch backend on random batches (no cache,
paged prefill with prefix hits, mixed decode + prefill, pure decode, GQA/MQA, head dims and
dtypes), and drives the engine to transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch
from engine_matrix import check_mode, hf_greedy, run_engine
from tiny_models import make_tiny_model, tiny_configs

from llmaccel.errors import LLMAccelError
from llmaccel.kernels.attention_ref import reshape_and_cache_ref
from llmaccel.models.attention.backend import TorchAttentionBackend
from llmaccel.models.attention.flex import FlexAttentionBackend, _eager_flex_attention
from llmaccel.models.attention.metadata import AttentionMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 64
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def paged_batch(cached: list[int], new: list[int], heads: int, kv_heads: int, d: int,
                dtype: torch.dtype, seed: int = 0, pad_rows: int = 0):
    """A step where sequence i already holds cached[i] tokens in a shuffled paged cache and
    brings new[i] tokens: (q, k, v, cache, meta)."""
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, d, dtype=dtype)
    tables, slots = [], []
    for c, n in zip(cached, new):
        table = [free.pop() for _ in range(-(-(c + n) // BLOCK_SIZE))]
        tables.append(table)
        prefix = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                               for p in range(c)], dtype=torch.long)
        reshape_and_cache_ref(torch.randn(c, kv_heads, d, dtype=dtype),
                              torch.randn(c, kv_heads, d, dtype=dtype), cache, prefix)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, c + n)]
    num_rows = sum(new) + pad_rows
    meta = AttentionMetadata.build(new, [c + n for c, n in zip(cached, new)], "cpu",
                                   slots + [-1] * pad_rows, tables)
    q = torch.randn(num_rows, heads, d, dtype=dtype)
    k = torch.randn(num_rows, kv_heads, d, dtype=dtype)
    v = torch.randn(num_rows, kv_heads, d, dtype=dtype)
    return q, k, v, cache, meta


def assert_matches_torch(q, k, v, cache, meta, scale=0.3):
    ref_cache = None if cache is None else cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale)
    got = FlexAttentionBackend().forward(q, k, v, cache, meta, scale)
    tol = TOLERANCE[q.dtype]
    n = meta.num_tokens
    torch.testing.assert_close(got[:n], want[:n], atol=tol, rtol=tol)
    if cache is not None:
        torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    return got


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 2), (4, 1)])
def test_prefill_without_cache(heads, kv_heads):
    lens = [5, 1, 17, 9, 130]  # 130: more than one 128-row block of the BlockMask
    d = 16
    q = torch.randn(sum(lens), heads, d)
    k, v = torch.randn(2, sum(lens), kv_heads, d)
    assert_matches_torch(q, k, v, None, AttentionMetadata.for_prefill(lens, "cpu"))


@pytest.mark.parametrize("d", [16, 24, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 4)])
def test_paged_prefill_with_prefix_hits(d, heads, kv_heads):
    assert_matches_torch(*paged_batch([0, 16, 33, 5], [7, 5, 20, 1], heads, kv_heads, d,
                                      torch.float32))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1)])
def test_mixed_decode_and_prefill(heads, kv_heads):
    assert_matches_torch(*paged_batch([12, 0, 40, 3, 0], [1, 9, 1, 6, 1], heads, kv_heads, 24,
                                      torch.float32, seed=1))


def test_pure_decode():
    assert_matches_torch(*paged_batch([12, 7, 30, 0, 55], [1] * 5, 8, 2, 64, torch.float32,
                                      seed=2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    assert_matches_torch(*paged_batch([9, 0, 21], [4, 11, 1], 4, 2, 64, dtype, seed=3))


def test_padding_rows_attend_to_nothing():
    """Rows past the last sequence (a padded batch) come back as zeros and leave the real
    rows alone."""
    got = assert_matches_torch(*paged_batch([3, 8], [2, 1], 4, 2, 16, torch.float32, seed=4,
                                            pad_rows=3))
    assert torch.equal(got[3:], torch.zeros_like(got[3:]))


def test_step_plan_is_shared_across_layers():
    """Two layers (two caches) in one step reuse the first layer's plan and still match."""
    q, k, v, cache, meta = paged_batch([6, 0], [3, 5], 4, 2, 16, torch.float32, seed=5)
    cache2 = torch.randn_like(cache)
    flex, ref = FlexAttentionBackend(), TorchAttentionBackend()
    outs = [flex.forward(q, k, v, c, meta, 0.25) for c in (cache.clone(), cache2.clone())]
    plan = flex._plan
    again = flex.forward(q, k, v, cache.clone(), meta, 0.25)
    assert flex._plan is plan
    torch.testing.assert_close(again, outs[0], atol=0, rtol=0)
    for out, c in zip(outs, (cache, cache2)):
        torch.testing.assert_close(out, ref.forward(q, k, v, c.clone(), meta, 0.25),
                                   atol=1e-5, rtol=1e-5)


def test_compiled_head_dim_limit():
    backend = FlexAttentionBackend()
    with pytest.raises(LLMAccelError, match="head_dim 8"):
        backend.attention_fn("cuda", 8)
    assert backend.attention_fn("cuda", 24) is not _eager_flex_attention
    assert backend.attention_fn("cpu", 8) is _eager_flex_attention
    assert FlexAttentionBackend(compiled=False).attention_fn("cuda", 8) is _eager_flex_attention


def test_engine_matches_transformers(tmp_path):
    """Greedy tokens through the engine with the flex backend equal transformers', with
    prefix-cache hits, chunked prefill (mixed decode + prefill steps) and a preemption.
    Mistral: head_dim 24 (not a power of two), GQA. Eager flex on CPU costs ~0.2 s per layer
    call, so the workload is small: ~35 steps."""
    hf = make_tiny_model(tiny_configs()["mistral"], tmp_path)
    rng = random.Random(0)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(48)]
    prompts = [[rng.randrange(vocab)], [rng.randrange(vocab) for _ in range(70)]]
    prompts += [shared + [rng.randrange(vocab) for _ in range(rng.randint(5, 15))]
                for _ in range(3)]
    max_tokens = [8, 12, 24, 24, 24]
    expected = hf_greedy(hf, prompts, max_tokens)
    # 12 blocks of 16 cannot hold all five sequences at once: forces a preemption.
    llm, got = run_engine(str(tmp_path), "all-three", prompts, max_tokens,
                          skip_tokenizer_init=True, attention_backend="flex",
                          max_num_batched_tokens=16, num_gpu_blocks=12, max_model_len=192)
    assert isinstance(llm.engine.model.attention_backend, FlexAttentionBackend)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens): {g} != {e}"
    check_mode(llm, "all-three")
