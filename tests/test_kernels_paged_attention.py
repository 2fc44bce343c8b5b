"""Triton paged decode attention against its PyTorch reference: small cases under
TRITON_INTERPRET=1 on CPU (CI), awkward sizes on a GPU (`pytest -m gpu`)."""

import random

import pytest
import torch

from llmaccel.kernels.attention_ref import paged_decode_attention_ref

# Without a GPU, conftest.py has set TRITON_INTERPRET=1: the kernels run in Triton's interpreter.
triton = pytest.importorskip("triton")


def _case(lens, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    sl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), cache.to(dtype), bt, sl)]


def _check(lens, heads, kv_heads, head_dim, block_size, dtype, device, atol):
    from llmaccel.kernels.paged_attention import paged_decode_attention
    q, cache, bt, sl = _case(lens, heads, kv_heads, head_dim, block_size, dtype, device)
    scale = head_dim ** -0.5
    want = paged_decode_attention_ref(q.float(), cache.float(), bt, sl, scale)
    got = paged_decode_attention(q, cache, bt, sl, scale)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 1, 32), (3, 3, 16)])
def test_paged_decode_small(heads, kv_heads, head_dim):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check([1, 5, 17, 33], heads, kv_heads, head_dim, 4, torch.float32, device, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (24, 8, 128), (12, 2, 128),
                                                     (9, 3, 64)])
def test_paged_decode_gpu(dtype, heads, kv_heads, head_dim):
    lens = [1, 15, 16, 17, 255, 1000, 4097]
    _check(lens, heads, kv_heads, head_dim, 16, dtype, "cuda", atol=2e-2)
