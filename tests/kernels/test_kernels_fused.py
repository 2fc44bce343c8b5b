"""Fused Triton kernels (RMSNorm, SiluAndMul, rotary, reshape_and_cache) against their PyTorch
references and the model layers they replace: small awkward cases under TRITON_INTERPRET=1 on
CPU (CI), awkward sizes and bf16/fp16/fp32 on a GPU (`pytest -m gpu`)."""


import pytest
import torch

from llmaccel.models.layers.activation import SiluAndMul
from llmaccel.models.layers.norm import RMSNorm
from llmaccel.models.layers.rotary import RotaryEmbedding

# Without a GPU, conftest.py has set TRITON_INTERPRET=1: the kernels run in Triton's interpreter.
triton = pytest.importorskip("triton")

from llmaccel.kernels.activation import silu_and_mul, silu_and_mul_ref
from llmaccel.kernels.cache import reshape_and_cache, reshape_and_cache_ref
from llmaccel.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_fp8,
    rms_norm_ref,
)
from llmaccel.kernels.rotary import rotary_embedding, rotary_embedding_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (atol, rtol) for kernel vs reference in the same dtype: a unit in the last place or two.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _randn(*shape, dtype=torch.float32, device=DEVICE, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _close(got, want, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


# --- RMSNorm ---------------------------------------------------------------------------------

def _check_rms(tokens, hidden, dtype, device):
    eps = 1e-6
    x = _randn(tokens, hidden, dtype=dtype, device=device, seed=1) * 3
    res = _randn(tokens, hidden, dtype=dtype, device=device, seed=2)
    w = _randn(hidden, dtype=dtype, device=device, seed=3)
    layer = RMSNorm(hidden, eps).to(device=device, dtype=dtype)
    layer.weight.data.copy_(w)

    got = rms_norm(x, w, eps)
    _close(got, rms_norm_ref(x, w, eps), dtype)
    _close(got, layer(x), dtype)

    want_out, want_res = layer(x, res)
    x0, res_ref = x.clone(), res.clone()
    ref_out, ref_res = fused_add_rms_norm_ref(x, res_ref, w, eps)
    res_k = res.clone()
    out, new_res = fused_add_rms_norm(x, res_k, w, eps)
    assert new_res.data_ptr() == res_k.data_ptr()  # residual updated in place, as documented
    assert torch.equal(x, x0)  # x left unchanged
    _close(out, ref_out, dtype)
    _close(new_res, ref_res, dtype)
    _close(out, want_out, dtype)
    _close(new_res, want_res, dtype)


@pytest.mark.parametrize("tokens,hidden", [(1, 48), (7, 100)])
def test_rms_norm_small(tokens, hidden):
    _check_rms(tokens, hidden, torch.float32, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (7, 2048), (1000, 3072), (333, 1536)])
def test_rms_norm_gpu(dtype, tokens, hidden):
    _check_rms(tokens, hidden, dtype, "cuda")


def _check_rms_fp8(tokens, hidden, dtype, device):
    """rms_norm_fp8 = rms_norm (or fused_add_rms_norm, residual updated the same way) then the
    per-token FP8 quantization, bit for bit: against the two kernels it replaces (the
    interpreter rounds bf16 by truncation in both) and against quantize_fp8_per_token of the
    separate norm's output."""
    from llmaccel.kernels.gemv_fp8 import quantize_row_fp8
    from llmaccel.quant.fp8 import quantize_fp8_per_token

    eps = 1e-6
    x = _randn(tokens, hidden, dtype=dtype, device=device, seed=1) * 3
    res = _randn(tokens, hidden, dtype=dtype, device=device, seed=2)
    w = _randn(hidden, dtype=dtype, device=device, seed=3)
    for residual in (None, res):
        r_sep = None if residual is None else residual.clone()
        r_fused = None if residual is None else residual.clone()
        normed = (rms_norm(x, w, eps) if residual is None
                  else fused_add_rms_norm(x, r_sep, w, eps)[0])
        q, scale, r_out = rms_norm_fp8(x, w, eps, r_fused)
        assert q.dtype == dtype and q.shape == x.shape and scale.shape == (tokens,)
        if residual is not None:
            assert r_out is r_fused and torch.equal(r_fused, r_sep)
        want_q, want_scale = quantize_fp8_per_token(normed)
        assert torch.equal(q.float(), want_q.float())
        assert torch.equal(scale, want_scale.reshape(-1).float())
        if tokens == 1:
            row_q, row_scale = quantize_row_fp8(normed)
            assert torch.equal(q, row_q) and torch.equal(scale, row_scale)


@pytest.mark.parametrize("tokens,hidden", [(1, 48), (3, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fp8_small(tokens, hidden, dtype):
    _check_rms_fp8(tokens, hidden, dtype, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 3072), (1, 1536), (5, 2048)])
def test_rms_norm_fp8_gpu(dtype, tokens, hidden):
    _check_rms_fp8(tokens, hidden, dtype, "cuda")


# --- SiluAndMul ------------------------------------------------------------------------------

def _check_silu(tokens, n, dtype, device, block=1024):
    x = _randn(tokens, 2 * n, dtype=dtype, device=device, seed=4) * 4
    got = silu_and_mul(x, block=block)
    assert got.shape == (tokens, n)
    _close(got, silu_and_mul_ref(x), dtype)
    _close(got, SiluAndMul()(x), dtype)


@pytest.mark.parametrize("tokens,n,block", [(1, 48, 1024), (7, 100, 32)])
def test_silu_and_mul_small(tokens, n, block):
    _check_silu(tokens, n, torch.float32, DEVICE, block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,n", [(1, 1536), (7, 8192), (1000, 3072), (333, 1000)])
def test_silu_and_mul_gpu(dtype, tokens, n):
    _check_silu(tokens, n, dtype, "cuda")


# --- Rotary ----------------------------------------------------------------------------------

def _check_rotary(tokens, heads, kv_heads, head_dim, dtype, device, max_pos=4096):
    rope = RotaryEmbedding(head_dim, max_pos, ROPE).to(device)
    cache = rope.cos_sin_cache
    gen = torch.Generator(device="cpu").manual_seed(5)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    # q and k as strided slices of a fused qkv projection, as the attention layer has them.
    qkv = _randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, device=device, seed=6)
    q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]
    want_q, want_k = rope(positions, q, k)
    ref_q, ref_k = rotary_embedding_ref(positions, q.clone(), k.clone(), cache)
    qkv_before = qkv.clone()
    got_q, got_k = rotary_embedding(positions, q, k, cache)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(qkv[:, heads + kv_heads:], qkv_before[:, heads + kv_heads:])  # v untouched
    for got, ref, want in ((got_q, ref_q, want_q), (got_k, ref_k, want_k)):
        _close(got, ref, dtype)
        _close(got, want, dtype)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 3, 1, 16), (7, 3, 1, 32)])
def test_rotary_small(tokens, heads, kv_heads, head_dim):
    _check_rotary(tokens, heads, kv_heads, head_dim, torch.float32, DEVICE, max_pos=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim",
                         [(1, 9, 3, 64), (7, 32, 8, 128), (1000, 24, 8, 128), (333, 15, 5, 64)])
def test_rotary_gpu(dtype, tokens, heads, kv_heads, head_dim):
    _check_rotary(tokens, heads, kv_heads, head_dim, dtype, "cuda")


# --- reshape_and_cache -----------------------------------------------------------------------

def _check_cache(tokens, kv_heads, head_dim, block_size, dtype, cache_dtype, device):
    num_blocks = -(-tokens // block_size) + 3
    gen = torch.Generator(device="cpu").manual_seed(7)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.2] = -1  # padding tokens
    if tokens > 1:
        slots[1] = -1
    slots = slots.to(device=device, dtype=torch.int32)
    # key and value as strided slices of a fused kv tensor.
    kv = _randn(tokens, 2 * kv_heads + 1, head_dim, dtype=dtype, device=device, seed=8)
    key, value = kv[:, :kv_heads], kv[:, kv_heads + 1:]
    # The cache sits after a guard region, so a write through slot -1 lands in the guard
    # (and is caught) instead of outside the allocation.
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    guard = block_size * kv_heads * head_dim
    buf = _randn(guard + torch.Size(shape).numel(), dtype=cache_dtype, device=device, seed=9)
    buf_before = buf.clone()
    cache = buf[guard:].view(shape)
    want = cache.clone()
    reshape_and_cache_ref(key, value, want, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, want)  # a copy (and a cast): exact
    assert torch.equal(buf[:guard], buf_before[:guard])


@pytest.mark.parametrize("tokens,kv_heads,head_dim,block_size,cache_dtype",
                         [(1, 1, 16, 4, torch.float32), (7, 3, 32, 4, torch.float32),
                          (7, 1, 16, 2, torch.float16)])
def test_reshape_and_cache_small(tokens, kv_heads, head_dim, block_size, cache_dtype):
    _check_cache(tokens, kv_heads, head_dim, block_size, torch.float32, cache_dtype, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,kv_heads,head_dim", [(1, 8, 128), (7, 3, 64), (1000, 8, 128),
                                                      (333, 5, 64)])
def test_reshape_and_cache_gpu(dtype, tokens, kv_heads, head_dim):
    _check_cache(tokens, kv_heads, head_dim, 16, dtype, dtype, "cuda")
