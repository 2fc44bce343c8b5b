"""The Triton greedy kernel (argmax + logprob) against the torch path it replaces on GPU."""

import pytest
import torch

from llmaccel.kernels.greedy_select import greedy_with_logprobs

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


@pytest.mark.parametrize("rows,vocab,chunk", [(1, 1000, 128), (3, 777, 64), (2, 100, 4096)])
@pytest.mark.parametrize("mapped", [False, True])
def test_greedy_ids_into_writes_the_mapped_argmax_twice(rows, vocab, chunk, mapped):
    """A chained draft step's pick (greedy_ids_into): the first-occurrence argmax, through a
    draft vocabulary's ids where given, into a float64 row and an int64 row, as the torch
    reference (kernels/greedy_select.write_greedy_ids on the CPU) writes them."""
    from llmaccel.kernels.greedy import greedy_ids_into
    from llmaccel.kernels.greedy_select import write_greedy_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    if rows > 1:  # a tie across chunks: the first occurrence wins
        logits[1, 3] = logits[1, vocab - 2] = logits[1].max() + 1
    ids = (torch.randperm(50000, generator=gen)[:vocab].sort().values if mapped else None)
    got_f = torch.full((rows,), -1.0, dtype=torch.float64, device=device)
    got_i = torch.full((rows,), -1, dtype=torch.long, device=device)
    greedy_ids_into(logits.to(device), None if ids is None else ids.to(device), got_f, got_i,
                    chunk=chunk)
    want_f = torch.empty(rows, dtype=torch.float64)
    want_i = torch.empty(rows, dtype=torch.long)
    write_greedy_ids(logits, ids, want_f, want_i)  # the CPU tensors: the torch reference
    arg = logits.argmax(-1)
    assert want_i.tolist() == (ids[arg] if mapped else arg).tolist()
    assert got_f.cpu().tolist() == want_f.tolist() and got_i.cpu().tolist() == want_i.tolist()
