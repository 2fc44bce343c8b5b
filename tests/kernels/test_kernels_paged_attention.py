"""Triton paged decode attention (single pass and split-K) against its PyTorch reference: small
cases under TRITON_INTERPRET=1 on CPU (CI), awkward sizes on a GPU (`pytest -m gpu`)."""

import random

import pytest
import torch

from llmaccel.kernels.attention_ref import paged_decode_attention_ref

# Without a GPU, conftest.py has set TRITON_INTERPRET=1: the kernels run in Triton's interpreter.
triton = pytest.importorskip("triton")


def _case(lens, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Scattered block tables; every cache slot no sequence owns is NaN, so a kernel that reads
    past a sequence's end (or through a -1 pad) poisons its output."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    for table, n in zip(tables, lens):
        for pos in range(n):
            cache[:, table[pos // block_size], pos % block_size] = torch.randn(
                2, kv_heads, head_dim, generator=gen)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    sl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), cache.to(dtype), bt, sl)]


def _check(lens, heads, kv_heads, head_dim, block_size, dtype, device, atol, num_splits=1,
           block_n=32):
    from llmaccel.kernels.paged_attention import paged_decode_attention
    q, cache, bt, sl = _case(lens, heads, kv_heads, head_dim, block_size, dtype, device)
    scale = head_dim ** -0.5
    want = paged_decode_attention_ref(q.float(), cache.float(), bt, sl, scale)
    got = paged_decode_attention(q, cache, bt, sl, scale, num_splits=num_splits, block_n=block_n)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 1, 32), (3, 3, 16)])
def test_paged_decode_small(heads, kv_heads, head_dim):
    _check([1, 5, 17, 33], heads, kv_heads, head_dim, 4, torch.float32, _device(), atol=2e-3)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 24), (3, 1, 32)])
def test_paged_decode_split_k(num_splits, heads, kv_heads, head_dim):
    # block_n 16: 33 tokens make 3 tiles, so splits get 1-2 tiles, a partial one, or none
    # (seq_len 1 with 8 splits leaves 7 empty splits, which must not produce NaN).
    _check([1, 5, 17, 33], heads, kv_heads, head_dim, 4, torch.float32, _device(), atol=2e-3,
           num_splits=num_splits, block_n=16)


def test_paged_decode_split_k_replays_with_new_lengths():
    """Split ranges come from seq_lens on the device: the same launch (same tensors, same
    grid), as a replayed CUDA graph would do it, is right after the lengths change in place."""
    from llmaccel.kernels.paged_attention import paged_decode_attention
    q, cache, bt, sl = _case([9, 40], 4, 2, 16, 4, torch.float32, _device())
    for lens in ([9, 40], [3, 1], [9, 33]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        got = paged_decode_attention(q, cache, bt, sl, 0.25, num_splits=4, block_n=16)
        want = paged_decode_attention_ref(q, cache, bt, sl, 0.25)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_zero_length_gives_zeros(num_splits):
    """A padded batch row (seq_len 0) must come out finite (zeros), never NaN."""
    from llmaccel.kernels.paged_attention import paged_decode_attention
    q, cache, bt, sl = _case([0, 6], 2, 1, 16, 4, torch.float32, _device())
    got = paged_decode_attention(q, cache, bt, sl, 0.25, num_splits=num_splits)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    want = paged_decode_attention_ref(q[1:], cache, bt[1:], sl[1:], 0.25)
    torch.testing.assert_close(got[1:], want, atol=2e-3, rtol=0)


def test_split_heuristic():
    from llmaccel.kernels.paged_attention import MAX_SPLITS, choose_num_splits, splits_for
    assert splits_for(programs=264, num_sms=132) == 1            # already two waves
    assert splits_for(programs=8, num_sms=132) == MAX_SPLITS     # one sequence, 8 KV heads
    assert splits_for(programs=64, num_sms=132) == 5             # ceil(264 / 64)
    assert splits_for(programs=8, num_sms=132, max_seq_len_hint=300) == 1   # short context
    assert splits_for(programs=8, num_sms=132, max_seq_len_hint=1024) == 4
    assert splits_for(programs=8, num_sms=132, max_seq_len_hint=100_000) == MAX_SPLITS
    assert choose_num_splits(1, 8, device="cpu") == 1            # interpreter: never split


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3, 16, None])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (24, 8, 128), (12, 2, 128),
                                                     (9, 3, 64), (10, 2, 80), (7, 7, 24)])
def test_paged_decode_gpu(dtype, num_splits, heads, kv_heads, head_dim):
    lens = [1, 15, 16, 17, 255, 1000, 3999, 4097]
    _check(lens, heads, kv_heads, head_dim, 16, dtype, "cuda", atol=2e-2, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_gpu_one_long_sequence(block_size):
    """One sequence: the case split-K exists for (num_splits None picks many splits)."""
    _check([4000], 32, 8, 128, block_size, torch.bfloat16, "cuda", atol=2e-2, num_splits=None)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_fused_combine_equals_the_combine_kernel(num_splits, monkeypatch):
    """The last split merging in the decode kernel gives the separate combine kernel's output,
    and leaves its arrival counters at 0 for the next call."""
    from llmaccel.kernels import paged_attention as pa
    from llmaccel.kernels.paged_attention import paged_decode_attention

    q, cache, bt, sl = _case([1, 37, 90], 6, 2, 32, 16, torch.float32, _device(), seed=4)
    pa._counters.clear()
    want = paged_decode_attention(q, cache, bt, sl, 0.3, num_splits=num_splits, block_n=16,
                                  _fused_combine=False)
    assert not pa._counters  # the two-kernel path takes no counters
    for _ in range(2):  # the second call relies on the first having reset the counters
        got = paged_decode_attention(q, cache, bt, sl, 0.3, num_splits=num_splits, block_n=16)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (counters,) = pa._counters.values()
    assert counters.numel() >= 3 * 2 and int(counters.abs().sum()) == 0


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (1, 32)])
def test_kv_fresh_from_reads_old_and_new_positions(num_splits, block_n):
    """With kv_fresh_from the kernel loads a tile's K/V in two parts (below the row's fresh
    position early, the rest after the PDL wait) and merges them: every split of the range
    [0, seq_len) must still see every key. Fresh positions at 0 (a prompt run as rows), in
    the middle of a tile, at the last position (a decode row) and past the end."""
    from llmaccel.kernels.paged_attention import paged_decode_attention
    lens = [1, 5, 17, 33, 40, 9]
    q, cache, bt, sl = _case(lens, 4, 2, 24, 4, torch.float32, _device(), seed=7)
    fresh = torch.tensor([0, 4, 16, 20, 0, 50], dtype=torch.int64, device=q.device)
    want = paged_decode_attention_ref(q, cache, bt, sl, 0.3)
    got = paged_decode_attention(q, cache, bt, sl, 0.3, num_splits=num_splits, block_n=block_n,
                                 kv_fresh_from=fresh)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


def test_kv_fresh_from_is_checked():
    from llmaccel.kernels.paged_attention import paged_decode_attention
    q, cache, bt, sl = _case([3, 4], 2, 1, 16, 4, torch.float32, _device())
    with pytest.raises(ValueError, match="kv_fresh_from"):
        paged_decode_attention(q, cache, bt, sl, 0.3, kv_fresh_from=sl[:1].long())
    with pytest.raises(ValueError, match="kv_fresh_from"):
        paged_decode_attention(q, cache, bt, sl, 0.3, kv_fresh_from=sl.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 16])
def test_kv_fresh_from_under_pdl_sees_the_new_token(num_splits):
    """The case the early K/V load must not get wrong: in one CUDA graph, a PDL kernel writes
    each row's new token into the cache (rotary_and_cache, as in a decode step) and the decode
    attention, launched with PDL right after it, reads the older positions before its wait.
    Replayed over several steps with new tokens each time, every output matches the reference
    over the cache as it stands after the write."""
    from llmaccel.kernels import pdl
    from llmaccel.kernels.paged_attention import paged_decode_attention
    from llmaccel.kernels.rotary import rotary_and_cache
    if torch.cuda.get_device_capability() < pdl.PDL_MIN_CAPABILITY:
        pytest.skip("PDL needs compute capability 9.0")
    was = pdl.enabled()
    pdl.set_enabled(True)
    try:
        heads, kv_heads, d, bs = 24, 8, 128, 16
        lens0 = [100, 31, 300]
        q0, cache, bt, sl = _case([n + 8 for n in lens0], heads, kv_heads, d, bs,
                                  torch.bfloat16, "cuda", seed=3)
        b = len(lens0)
        pos = torch.tensor(lens0, dtype=torch.int64, device="cuda")
        slots = torch.empty(b, dtype=torch.int64, device="cuda")
        q = torch.empty(b, heads, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(b, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        v = torch.empty_like(k)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        ang = torch.arange(4096, device="cuda").float()[:, None] * inv[None, :]
        cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).contiguous()

        def step():
            rotary_and_cache(pos, q, k, v, cos_sin, cache, slots)
            return paged_decode_attention(q, cache, bt, sl, d ** -0.5, num_splits=num_splits,
                                          kv_fresh_from=pos)

        def set_inputs(s, gen):
            pos.copy_(torch.tensor([n + s for n in lens0], device="cuda"))
            sl.copy_((pos + 1).int())
            blocks = bt.long().gather(1, (pos // bs)[:, None])[:, 0]
            slots.copy_(blocks * bs + pos % bs)
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=gen).to(t))

        gen = torch.Generator().manual_seed(0)
        set_inputs(0, gen)
        step()  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for s in range(1, 8):
            set_inputs(s, gen)
            graph.replay()
            torch.cuda.synchronize()
            # what the graph's rope wrote is in the cache now: the reference reads the same
            want = paged_decode_attention_ref(q.float(), cache.float(), bt, sl, d ** -0.5)
            # q was rotated in place by the graph's rope kernel, so the reference sees it
            torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
    finally:
        pdl.set_enabled(was)
