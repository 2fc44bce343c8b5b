"""The Triton greedy kernel (argmax + logprob) against the torch path it replaces on GPU."""

import pytest
import torch

from llmaccel.engine.sampler import greedy_with_logprobs

triton = pytest.importorskip("triton")


def _check(rows, vocab, dtype, device, chunk):
    from llmaccel.kernels.greedy import greedy_sample
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    if rows > 1:  # a tie across chunks: the first occurrence wins, as in torch.argmax
        logits[1, 3] = logits[1, vocab - 2] = logits[1].max() + 1
    logits = logits.to(device)
    want = greedy_with_logprobs(logits)
    got = greedy_sample(logits, chunk=chunk)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,vocab,chunk", [(1, 1000, 128), (3, 777, 64), (2, 100, 4096)])
def test_greedy_small(rows, vocab, chunk):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(rows, vocab, torch.float32, device, chunk)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (7, 151936), (64, 49152)])
def test_greedy_gpu(rows, vocab, dtype):
    _check(rows, vocab, dtype, "cuda", 4096)
