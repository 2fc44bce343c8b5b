"""Triton varlen prefill/extend attention against the PyTorch references: small cases under
TRITON_INTERPRET=1 on CPU (CI), realistic sizes on a GPU (`pytest -m gpu`).

Cases mix full prefills, prefix-cache hits / chunked prefill (q_len < seq_len) and decode rows
(q_len 1) in one batch, with GQA, odd head dims and scattered block tables."""

import random
from itertools import accumulate

import pytest
import torch

from llmaccel.kernels.attention_ref import paged_attention_ref, varlen_attention_ref

# Without a GPU, conftest.py has set TRITON_INTERPRET=1: the kernels run in Triton's interpreter.
triton = pytest.importorskip("triton")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _paged_case(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Scattered block tables; every cache slot no sequence owns is NaN, so reading past a
    sequence's end or through a -1 pad poisons the output."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    for table, n in zip(tables, seq_lens):
        blocks = torch.tensor(table, dtype=torch.long)[torch.arange(n) // block_size]
        cache[:, blocks, torch.arange(n) % block_size] = torch.randn(
            2, n, kv_heads, head_dim, generator=gen)
    width = max(1, max(len(t) for t in tables))
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = [0, *accumulate(q_lens)]
    q = torch.randn(qsl[-1], heads, head_dim, generator=gen)
    return q.to(dtype).to(device), cache.to(dtype).to(device), bt.to(device), qsl


def _check_paged(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, device,
                 atol, rtol=0.0):
    from llmaccel.kernels.prefill_attention import paged_prefill_attention
    q, cache, bt, qsl = _paged_case(seq_lens, q_lens, heads, kv_heads, head_dim, block_size,
                                    dtype, device)
    scale = head_dim ** -0.5
    got = paged_prefill_attention(
        q, cache, bt, torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), scale, max(q_lens))
    want = paged_attention_ref(q.float(), cache.float(), bt, qsl, seq_lens, scale)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def _check_varlen(lens, heads, kv_heads, head_dim, dtype, device, atol, rtol=0.0):
    """k/v as strided views of one packed qkv projection, as a model produces them."""
    from llmaccel.kernels.prefill_attention import varlen_prefill_attention
    gen = torch.Generator(device="cpu").manual_seed(1)
    qkv = torch.randn(sum(lens), heads + 2 * kv_heads, head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    qsl = [0, *accumulate(lens)]
    scale = head_dim ** -0.5
    got = varlen_prefill_attention(q, k, v, torch.tensor(qsl, dtype=torch.int32, device=device),
                                   scale, max(lens))
    want = varlen_attention_ref(q.float(), k.float(), v.float(), qsl, scale)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


# seq_lens / q_lens: decode row, full prefill, prefix hit mid-block, another decode row,
# chunk of a long prompt (prefix over several key tiles), a full prefill over several tiles.
MIXED = ([17, 7, 40, 1, 50, 33], [1, 7, 12, 1, 33, 33])


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 2, 16, 4), (6, 2, 24, 16), (3, 3, 32, 4), (8, 1, 16, 16)])
def test_paged_prefill_mixed_batch(heads, kv_heads, head_dim, block_size):
    _check_paged(*MIXED, heads, kv_heads, head_dim, block_size, torch.float32, _device(),
                 atol=2e-3)


def test_paged_prefill_decode_only_and_prefix_only():
    """All rows q_len 1 (the smallest query tile) and one sequence with a long cached prefix."""
    _check_paged([5, 33, 18], [1, 1, 1], 6, 3, 16, 4, torch.float32, _device(), atol=2e-3)
    _check_paged([45], [3], 4, 2, 24, 16, torch.float32, _device(), atol=2e-3)


def test_paged_prefill_skips_sequences_without_queries():
    """A sequence with no new tokens (q_len 0) launches programs that must exit cleanly."""
    from llmaccel.kernels.prefill_attention import paged_prefill_attention
    seq_lens, q_lens = [6, 10], [0, 4]
    q, cache, bt, qsl = _paged_case(seq_lens, q_lens, 2, 1, 16, 4, torch.float32, _device())
    got = paged_prefill_attention(q, cache, bt, torch.tensor(qsl, dtype=torch.int32),
                                  torch.tensor(seq_lens, dtype=torch.int32), 0.25, 4)
    want = paged_attention_ref(q, cache, bt[1:], [0, 4], seq_lens[1:], 0.25)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 3, 24), (2, 2, 32)])
def test_varlen_prefill(heads, kv_heads, head_dim):
    _check_varlen([1, 9, 37, 16], heads, kv_heads, head_dim, torch.float32, _device(),
                  atol=2e-3)


GPU_HEADS = [(32, 8, 64), (24, 8, 128), (12, 2, 128), (9, 3, 64)]
# Tolerances for 16-bit inputs: P is rounded to the input dtype before the P @ V dot and the
# output is rounded once more; the reference runs in fp32 on the same (rounded) inputs.
ATOL, RTOL = 2e-2, 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", GPU_HEADS)
def test_paged_prefill_gpu(dtype, block_size, heads, kv_heads, head_dim):
    seq_lens = [1, 17, 300, 1000, 3000, 2049, 129, 777]
    q_lens = [1, 17, 45, 1000, 1, 2049, 128, 256]
    _check_paged(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, "cuda",
                 atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [*GPU_HEADS, (10, 2, 80)])
def test_varlen_prefill_gpu(dtype, heads, kv_heads, head_dim):
    _check_varlen([1, 63, 64, 65, 1000, 2500], heads, kv_heads, head_dim, dtype, "cuda",
                  atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paged_prefill_gpu_fp32_is_full_precision():
    """fp32 must not silently fall back to TF32 dots (which would miss 1e-4)."""
    _check_paged([700, 64], [300, 64], 8, 2, 64, 16, torch.float32, "cuda", atol=1e-4)
