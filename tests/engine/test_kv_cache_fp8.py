"""FP8 (e4m3) KV cache, `kv_cache_dtype="fp8"`: K/V stored as clamp(x / scale, +-448) cast to
float8_e4m3fn, read back as float(e4m3) * scale (scales 1.0 unless calibrated ones are given).

- The cache write (reference and Triton kernel) is byte-for-byte torch's saturating cast.
- The Triton decode and prefill/extend kernels, reading an fp8 cache, match the reference
  reading the same cache (small awkward cases under TRITON_INTERPRET=1 on CPU, large ones on a
  GPU with `pytest -m gpu`); so do the torch, triton and flex backends on one mixed step.
- The engine: the pool holds 4x (fp32 model) / 2x (bf16 model) the blocks for the same budget;
  its greedy tokens equal an fp32-cache run whose K/V are rounded to e4m3 before they are
  stored (prefix caching, chunked prefill and preemption on); and against the plain fp32 cache
  its per-step logits stay within the error that e4m3's 3-bit mantissa allows.
- Bad values and missing float8 support fail with clear errors.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from engine_matrix import check_mode, random_workload
from tiny_models import make_tiny_model, tiny_configs

from llmaccel import LLM, SamplingParams
from llmaccel.engine.config import EngineConfig
from llmaccel.engine.kv_cache import allocate_kv_caches, bytes_per_block, resolve_kv_cache_dtype
from llmaccel.errors import LLMAccelError
from llmaccel.kernels.attention_ref import (
    dequantize_kv,
    paged_attention_ref,
    paged_decode_attention_ref,
    quantize_kv,
    reshape_and_cache_ref,
)
from llmaccel.models.attention import AttentionMetadata, get_attention_backend
from llmaccel.models.attention.backend import TorchAttentionBackend
from llmaccel.models.loader import load_model

FP8 = torch.float8_e4m3fn
NAN_BYTE = 0x7F  # e4m3fn NaN (the interpreter decodes it as 480: still far off)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _saturating_cast(x: torch.Tensor) -> torch.Tensor:
    """The definition the cache write must reproduce bit for bit."""
    return x.clamp(-448, 448).to(FP8)


# Edge cases of the cast: +-0, the largest finite 448 and values above it (must saturate),
# ties between e4m3 neighbours (1.0625 -> 1.0 and 1.1875 -> 1.25: ties to even), a tie that
# carries into the next binade (15.5 * 2^-6 -> 2^-2), subnormals (spacing 2^-9) and their ties
# (2^-10 -> 0, 3 * 2^-10 -> 2^-8), and values below half the smallest subnormal.
SPECIAL = [0.0, -0.0, 448.0, -448.0, 449.0, 460.0, 464.0, -500.0, 3e4, 1.0625, 1.1875,
           -1.3125, 15.5 * 2**-6, 2**-9, -(2**-9), 2**-10, 3 * 2**-10, -5 * 2**-10, 2**-12,
           7 * 2**-9, 0.1235]


def _awkward(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over e4m3's whole range (2^-12 .. 2^9 in magnitude), SPECIAL first."""
    gen = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    x = torch.randn(n, generator=gen) * torch.exp2(
        torch.randint(-12, 10, (n,), generator=gen).float())
    k = min(n, len(SPECIAL))
    x[:k] = torch.tensor(SPECIAL[:k])
    return x.view(shape).to(dtype)


# --- the cache write -------------------------------------------------------------------------

def _write_case(tokens, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Strided key/value views of one fused tensor (as the model produces them), slots with
    -1 pads, and an fp8 cache after a guard region, every byte 0x5A (a value no write puts in
    an untouched slot by accident)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-tokens // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.2] = -1
    if tokens > 1:
        slots[1] = -1
    kv = _awkward((tokens, 2 * kv_heads + 1, head_dim), dtype, seed + 1).to(device)
    key, value = kv[:, :kv_heads], kv[:, kv_heads + 1:]
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    guard = block_size * kv_heads * head_dim
    buf = torch.full((guard + torch.Size(shape).numel(),), 0x5A, dtype=torch.uint8,
                     device=device)
    cache = buf[guard:].view(FP8).view(shape)
    return key, value, slots.to(device), buf, guard, cache


def _expected_bytes(key, value, slots, cache_before):
    """What the cache must hold: the saturating cast at each kept slot, the rest untouched."""
    want = _bytes(cache_before).clone().view(2, -1, *cache_before.shape[-2:])
    keep = slots >= 0
    want[0, slots[keep]] = _bytes(_saturating_cast(key[keep]))
    want[1, slots[keep]] = _bytes(_saturating_cast(value[keep]))
    return want.view(cache_before.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_write_is_the_saturating_cast(dtype):
    key, value, slots, buf, guard, cache = _write_case(37, 3, 24, 4, dtype, "cpu")
    want = _expected_bytes(key, value, slots, cache)
    reshape_and_cache_ref(key, value, cache, slots)
    assert torch.equal(_bytes(cache), want)
    assert torch.all(buf[:guard] == 0x5A)


def _check_triton_write(tokens, kv_heads, head_dim, block_size, dtype, device):
    from llmaccel.kernels.cache import reshape_and_cache
    key, value, slots, buf, guard, cache = _write_case(tokens, kv_heads, head_dim, block_size,
                                                       dtype, device)
    want = _expected_bytes(key, value, slots, cache)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(_bytes(cache), want)
    assert torch.all(buf[:guard] == 0x5A)  # slot -1 wrote nothing before the cache
    # Scales that are not powers of two: same bytes as the reference (both multiply by the
    # fp32 reciprocal, then saturate and round to nearest even).
    ref = cache.clone()
    reshape_and_cache_ref(key, value, ref, slots, 0.37, 3.0)
    reshape_and_cache(key, value, cache, slots, 0.37, 3.0)
    assert torch.equal(_bytes(cache), _bytes(ref))


@needs_triton
@pytest.mark.parametrize("tokens,kv_heads,head_dim,block_size,dtype", [
    (1, 1, 16, 4, torch.float32), (37, 3, 24, 4, torch.float32),
    (19, 2, 32, 2, torch.bfloat16), (11, 5, 16, 8, torch.float16)])
def test_triton_write_is_the_saturating_cast(tokens, kv_heads, head_dim, block_size, dtype):
    """Under the interpreter this runs the kernel's software e4m3 rounding (the interpreter's
    own float -> fp8 cast is wrong, see kernels/cache.py); the GPU test below runs the
    hardware conversion against the same bytes."""
    _check_triton_write(tokens, kv_heads, head_dim, block_size, dtype, _device())


def test_scales_round_trip_and_saturate():
    x = torch.linspace(-3.0, 3.0, 1001)
    for scale in (1.0, 2.0**-3, 0.0123):
        q = quantize_kv(x, FP8, scale)
        back = dequantize_kv(q, torch.float32, scale)
        normal = x.abs() / scale >= 2.0**-6  # e4m3's normal range: relative error <= 2^-4
        rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[normal]
        assert rel.max() <= 2.0**-4
        assert (back - x).abs()[~normal].max() <= 2.0**-10 * scale  # half a subnormal step
    # Beyond 448 * scale: the largest finite value, never NaN.
    big = dequantize_kv(quantize_kv(torch.tensor([10.0, -1e6]), FP8, 0.01), torch.float32, 0.01)
    torch.testing.assert_close(big, torch.tensor([4.48, -4.48]))


# --- attention kernels reading an fp8 cache --------------------------------------------------

def _fp8_cache(seq_lens, kv_heads, head_dim, block_size, device, seed=0):
    """Scattered block tables over an fp8 cache whose unowned bytes are NaN, so reading past a
    sequence's end or through a -1 pad poisons the output. Owned slots hold e4m3 values of
    random K/V (magnitudes up to a few units, some saturated)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), NAN_BYTE,
                       dtype=torch.uint8).view(FP8)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    flat = cache.view(2, -1, kv_heads, head_dim)
    for table, n in zip(tables, seq_lens):
        pos = torch.arange(n)
        slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size \
            + pos % block_size
        kv = torch.randn(2, n, kv_heads, head_dim, generator=gen) * 1.5
        _bytes(flat)[:, slots] = _bytes(quantize_kv(kv, FP8))
    width = max(1, max(len(t) for t in tables))
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return cache.to(device), bt.to(device)


SCALES = [(1.0, 1.0), (0.5, 3.0)]


def _check_decode(lens, heads, kv_heads, head_dim, block_size, dtype, device, atol,
                  num_splits, k_scale, v_scale, block_n=16, fresh=None):
    from llmaccel.kernels.paged_attention import paged_decode_attention
    cache, bt = _fp8_cache(lens, kv_heads, head_dim, block_size, device)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, cache, bt, sl, scale, num_splits=num_splits,
                                 block_n=block_n, k_scale=k_scale, v_scale=v_scale,
                                 kv_fresh_from=None if fresh is None else
                                 torch.tensor(fresh, device=device))
    want = paged_decode_attention_ref(q.float(), cache, bt, sl, scale, k_scale, v_scale)
    assert want.isfinite().all()
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


@needs_triton
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 24), (3, 3, 32)])
def test_paged_decode_reads_fp8_cache(heads, kv_heads, head_dim, num_splits, k_scale,
                                      v_scale):
    # 33 tokens with block_n 16: three tiles, the last partial; 3 splits leave one empty for
    # the short sequences. v_scale 3 triples the output: a kernel ignoring it cannot pass.
    _check_decode([1, 5, 17, 33], heads, kv_heads, head_dim, 4, torch.float32, _device(),
                  2e-3, num_splits, k_scale, v_scale)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_fp8_cache_with_kv_fresh_from(num_splits):
    """The graph decode steps' split K/V load (older positions before the PDL wait, this
    step's after it) on an FP8 cache: fresh at the start, inside a tile and at the last
    position give the reference output."""
    _check_decode([1, 5, 17, 33], 4, 2, 16, 4, torch.float32, _device(), 2e-3, num_splits,
                  0.5, 3.0, fresh=[0, 4, 9, 32])


def _check_prefill(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, device,
                   atol, rtol, k_scale, v_scale):
    from itertools import accumulate

    from llmaccel.kernels.prefill_attention import paged_prefill_attention
    cache, bt = _fp8_cache(seq_lens, kv_heads, head_dim, block_size, device)
    qsl = [0, *accumulate(q_lens)]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(qsl[-1], heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim ** -0.5
    got = paged_prefill_attention(
        q, cache, bt, torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), scale, max(q_lens),
        k_scale=k_scale, v_scale=v_scale)
    want = paged_attention_ref(q.float(), cache, bt, qsl, seq_lens, scale, k_scale, v_scale)
    assert want.isfinite().all()
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


# decode row, full prefill, prefix hit mid-block, decode row, chunk of a long prompt, prefill
# over several key tiles (the interpreter's tiles are 16 keys).
MIXED = ([17, 7, 40, 1, 50, 33], [1, 7, 12, 1, 33, 33])


@needs_triton
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 2, 16, 4), (6, 2, 24, 16), (8, 1, 16, 4)])
def test_paged_prefill_reads_fp8_cache(heads, kv_heads, head_dim, block_size, k_scale,
                                       v_scale):
    _check_prefill(*MIXED, heads, kv_heads, head_dim, block_size, torch.float32, _device(),
                   2e-3, 0.0, k_scale, v_scale)


def _backend_step(query_lens, seq_lens, heads=4, kv_heads=2, d=24, block_size=4, seed=0):
    """One engine-shaped step over an fp8 cache that already holds earlier tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    cache = _saturating_cast(torch.randn(2, num_blocks, block_size, kv_heads, d, generator=gen))
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, q, n in zip(tables, query_lens, seq_lens) for p in range(n - q, n)]
    meta = AttentionMetadata.build(query_lens, seq_lens, "cpu", slots, tables)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, d, generator=gen) * 2 for h in (heads, kv_heads, kv_heads))
    return q, k, v, cache, meta


@pytest.mark.parametrize("backend", [
    pytest.param("triton", marks=needs_triton), "flex"])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([3, 1, 1, 6], [11, 8, 1, 6]),   # prefix hit, decodes, a fresh prompt: one mixed step
    ([1, 1, 1], [13, 1, 30]),        # decode only
])
def test_backends_agree_on_fp8_cache(backend, query_lens, seq_lens):
    q, k, v, cache, meta = _backend_step(query_lens, seq_lens)
    ref_cache, got_cache = cache.clone(), cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0.25, 0.5, 3.0)
    got = get_attention_backend(backend).forward(q, k, v, got_cache, meta, 0.25, 0.5, 3.0)
    assert torch.equal(_bytes(got_cache), _bytes(ref_cache))  # same quantized K/V, same slots
    torch.testing.assert_close(got, want, atol=2e-4 if backend == "triton" else 1e-5, rtol=0)
    # The step really went through e4m3: full-precision K/V give a different answer.
    full = TorchAttentionBackend().forward(q, k, v, torch.zeros_like(cache, dtype=torch.float32),
                                           meta, 0.25)
    assert (full * 3.0 - want).abs().max() > 1e-2


# --- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_model(tiny_configs()["llama"], directory)
    return str(directory)


@pytest.mark.parametrize("dtype,ratio", [("float32", 4), ("bfloat16", 2)])
def test_pool_holds_more_blocks(tiny_llama, dtype, ratio):
    """Same 1 MiB CPU budget (small enough that max_num_seqs full sequences do not cap it):
    ratio x the blocks, the same bytes."""
    engines = {kv: LLM(tiny_llama, dtype=dtype, device="cpu", skip_tokenizer_init=True,
                       max_model_len=512, cpu_kv_cache_gib=2**-10, kv_cache_dtype=kv).engine
               for kv in ("auto", "fp8_e4m3")}
    auto, fp8 = engines["auto"], engines["fp8_e4m3"]
    assert fp8.kv_cache_dtype == FP8 and auto.kv_cache_dtype == getattr(torch, dtype)
    assert fp8.stats.num_blocks == ratio * auto.stats.num_blocks
    assert fp8.block_manager.num_available_blocks == fp8.stats.num_blocks
    caches = [e.runner.kv_caches for e in (auto, fp8)]
    assert {c.dtype for c in caches[1]} == {FP8}
    assert sum(c.nbytes for c in caches[0]) == sum(c.nbytes for c in caches[1])
    assert bytes_per_block(fp8.model, 16, FP8) * ratio == bytes_per_block(
        auto.model, 16, auto.kv_cache_dtype)


class _RoundKVToE4M3(TorchAttentionBackend):
    """Full-precision cache, but K/V rounded to e4m3 (the plain saturating cast) before they
    are stored: what an fp8 cache with scale 1 must compute, written independently of it."""

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        if kv_cache is not None and meta.uses_kv_cache:
            k, v = _saturating_cast(k).to(k.dtype), _saturating_cast(v).to(v.dtype)
        return super().forward(q, k, v, kv_cache, meta, scale)


def test_engine_fp8_equals_e4m3_rounded_fp32_cache(tiny_llama):
    """Greedy tokens and logprobs are identical for every prompt: the fp8 cache stores and
    reads exactly e4m3(K), e4m3(V) through prefix caching, chunked prefill and preemption
    (all three on, so shared, chunked and recomputed blocks are all read back)."""
    prompts, max_tokens = random_workload(160, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0)
              for m in max_tokens]
    mode = dict(enable_prefix_caching=True, max_num_batched_tokens=7, num_gpu_blocks=24,
                max_model_len=384)
    runs = {}
    for kv in ("fp8", "auto"):
        llm = LLM(tiny_llama, dtype="float32", device="cpu", skip_tokenizer_init=True,
                  kv_cache_dtype=kv, **mode)
        if kv == "auto":
            for layer in llm.engine.model.attention_layers():
                layer.backend = _RoundKVToE4M3()
        outs = llm.generate(prompts, params, use_tqdm=False)
        check_mode(llm, "all-three", launched_ahead=False)  # logprobs: no steps ahead
        runs[kv] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    for i, (got, want) in enumerate(zip(runs["fp8"], runs["auto"])):
        assert got[0] == want[0], f"prompt {i}: {got[0]} != {want[0]}"
        assert got[1] == want[1], f"prompt {i}: logprobs differ"


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "flex"])
def test_engine_fp8_backends_agree(backend, tmp_path):
    """The whole engine on an fp8 cache (head dim 24, chunked prefill, a prefix hit) gives the
    torch backend's greedy tokens and logprobs with the Triton kernels (the interpreter on
    CPU) or FlexAttention."""
    make_tiny_model(tiny_configs()["mistral"], tmp_path)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9] * 20, [5], list(range(40)), list(range(40)) + [3, 4]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = {}
    for name in ("torch", backend):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                  kv_cache_dtype="fp8", attention_backend=name, max_num_batched_tokens=16)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_stats().prefix_hit_rate > 0
        runs[name] = [o.outputs[0] for o in outs]
    for i, (got, want) in enumerate(zip(runs[backend], runs["torch"])):
        assert got.token_ids == want.token_ids, f"prompt {i}"
        lp_got = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        lp_want = [lp[t] for lp, t in zip(want.logprobs, want.token_ids)]
        torch.testing.assert_close(lp_got, lp_want, atol=1e-4, rtol=0)


class _PerturbKV(TorchAttentionBackend):
    """Full-precision cache with every stored K/V element multiplied by 1 +- 2^-4 (random
    sign): the largest relative error e4m3 rounding makes (half of the 2^-3 spacing that a
    3-bit mantissa leaves), on every element at once."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def _perturb(self, x: torch.Tensor) -> torch.Tensor:
        sign = torch.randint(0, 2, x.shape, generator=self.gen).to(x.dtype) * 2 - 1
        return x * (1 + sign * 2.0**-4)

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        return super().forward(q, self._perturb(k), self._perturb(v), kv_cache, meta, scale)


def _teacher_forced_logits(model, seqs, cache_dtype, seed=0):
    """Logits at every position of `seqs`, fed through the paged cache in mixed steps
    (prefill chunks and single decode tokens of all sequences batched together)."""
    rng = random.Random(seed)
    block_size, num_blocks = 4, 256
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
    model.bind_kv_caches(allocate_kv_caches(model, num_blocks, block_size, cache_dtype, "cpu"))
    done, got = [0] * len(seqs), [[] for _ in seqs]
    try:
        while any(d < len(s) for d, s in zip(done, seqs)):
            active = [i for i, s in enumerate(seqs) if done[i] < len(s)]
            chunks = {i: min(len(seqs[i]) - done[i], rng.choice([1, 1, 3, 20])) for i in active}
            ids, pos, slots = [], [], []
            for i in active:
                for p in range(done[i], done[i] + chunks[i]):
                    ids.append(seqs[i][p])
                    pos.append(p)
                    slots.append(tables[i][p // block_size] * block_size + p % block_size)
            meta = AttentionMetadata.build([chunks[i] for i in active],
                                           [done[i] + chunks[i] for i in active], "cpu", slots,
                                           [tables[i] for i in active])
            with torch.no_grad():
                logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), meta))
            for i, part in zip(active, logits.split([chunks[i] for i in active])):
                got[i].append(part)
                done[i] += chunks[i]
    finally:
        model.bind_kv_caches(None)
    return torch.cat([torch.cat(g) for g in got])


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_fp8_logits_stay_within_e4m3_error(family, tmp_path):
    """Per-position logits of the fp8 cache against the fp32 cache, same tokens (teacher
    forcing, so one flipped argmax cannot snowball). The tolerance comes from e4m3 itself:
    the fp8 run may deviate no more than a run whose every K/V element carries the largest
    relative rounding error, 2^-4 (measured: about 0.4x of it, in max and mean). And it must
    deviate (at least a tenth of that), or the cache was never quantized. Argmax, the greedy
    token, agrees at >= 90% of positions (random tiny models have many near-ties; 94-96%
    measured)."""
    make_tiny_model(tiny_configs()[family], tmp_path)
    _, model = load_model(str(tmp_path), dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 160, (n,), generator=gen).tolist()
            for n in (1, 9, 40, 130, 17, 64, 300)]
    base = _teacher_forced_logits(model, seqs, torch.float32)
    fp8 = _teacher_forced_logits(model, seqs, FP8)
    for layer in model.attention_layers():
        layer.backend = _PerturbKV(seed=0)
    bound = (_teacher_forced_logits(model, seqs, torch.float32) - base).abs()
    fp8_err = (fp8 - base).abs()
    assert fp8_err.max() <= bound.max(), (fp8_err.max(), bound.max())
    assert fp8_err.mean() <= bound.mean(), (fp8_err.mean(), bound.mean())
    assert fp8_err.mean() >= 0.1 * bound.mean(), (fp8_err.mean(), bound.mean())
    agree = (fp8.argmax(-1) == base.argmax(-1)).float().mean()
    assert agree >= 0.9, agree


# --- configuration errors --------------------------------------------------------------------

def test_unknown_kv_cache_dtype_names_the_allowed_values(tiny_llama):
    with pytest.raises(LLMAccelError, match="unknown kv_cache_dtype 'fp4'.*auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(LLMAccelError, match="int8"):
        LLM(tiny_llama, kv_cache_dtype="int8")


def test_cli_flag_reaches_the_engine_config():
    from typer.testing import CliRunner

    from llmaccel.cli import app
    result = CliRunner().invoke(app, ["generate", "no-such-model", "--kv-cache-dtype", "e5m2"])
    assert isinstance(result.exception, LLMAccelError)
    assert "kv_cache_dtype 'e5m2'" in str(result.exception)


def test_fp8_needs_float8_support(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu, "torch") == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cpu, "torch") == FP8
    # A GPU older than Ada/Hopper: Triton has no e4m3 there.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(LLMAccelError, match=r"compute capability >= 8\.9.*8\.0.*'torch'"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"), "triton")
    # A device whose torch kernels cannot cast to float8.
    def no_float8(*args, **kwargs):
        raise RuntimeError("\"copy_\" not implemented for 'Float8_e4m3fn'")
    monkeypatch.setattr(torch, "ones", no_float8)
    with pytest.raises(LLMAccelError, match="cannot use float8 tensors on cpu.*'auto'"):
        resolve_kv_cache_dtype("fp8", torch.float32, cpu, "torch")
    # A torch build without the dtype at all.
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(LLMAccelError, match="torch build with float8"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.float32, cpu, "torch")


# --- GPU (run on the device machine: `pytest -m gpu`) ----------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,kv_heads,head_dim", [(1, 8, 128), (1000, 8, 128),
                                                      (333, 5, 80), (77, 1, 24)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_write_gpu(dtype, tokens, kv_heads, head_dim):
    """The hardware fp32 -> e4m3 conversion (cvt.rn.satfinite) gives torch's bytes."""
    _check_triton_write(tokens, kv_heads, head_dim, 16, dtype, "cuda")


GPU_HEADS = [(32, 8, 64), (24, 8, 128), (12, 2, 128), (9, 3, 64), (10, 2, 80), (7, 7, 24)]


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3, 16, None])
@pytest.mark.parametrize("heads,kv_heads,head_dim", GPU_HEADS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paged_decode_fp8_gpu(heads, kv_heads, head_dim, num_splits, dtype, k_scale, v_scale):
    """Default tiles (block_n None: the fp8 ones, 128 or 64 keys), and 32 once."""
    lens = [1, 15, 16, 17, 255, 1000, 3999, 4097]
    for block_n in (None, 32):
        _check_decode(lens, heads, kv_heads, head_dim, 16, dtype, "cuda", 2e-2 * v_scale,
                      num_splits, k_scale, v_scale, block_n=block_n)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", GPU_HEADS[:4] + [(10, 2, 80)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paged_prefill_fp8_gpu(heads, kv_heads, head_dim, block_size, dtype, k_scale,
                               v_scale):
    seq_lens = [1, 17, 300, 1000, 3000, 2049, 129, 777]
    q_lens = [1, 17, 45, 1000, 1, 2049, 128, 256]
    _check_prefill(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, "cuda",
                   2e-2 * v_scale, 1e-2, k_scale, v_scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_fp8_gpu_triton_graphs(tiny_llama):
    """Triton backend with CUDA graphs on an fp8 cache: the same greedy tokens as the torch
    reference on an fp32 cache holding e4m3-rounded K/V (fp32 model, full-precision dots; the
    engine equivalence tests hold fp32 GPU runs to exact tokens the same way)."""
    from llmaccel.kernels import triton_supports_fp8
    assert triton_supports_fp8("cuda")
    prompts, max_tokens = random_workload(160, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    runs = {}
    for kv, backend in (("fp8", "triton"), ("auto", "torch")):
        llm = LLM(tiny_llama, dtype="float32", device="cuda", skip_tokenizer_init=True,
                  kv_cache_dtype=kv, attention_backend=backend, max_model_len=512)
        if kv == "fp8":
            assert llm.engine.runner.graphs is not None
        else:
            for layer in llm.engine.model.attention_layers():
                layer.backend = _RoundKVToE4M3()
        runs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
    for i, (got, want) in enumerate(zip(runs["fp8"], runs["auto"])):
        assert got == want, f"prompt {i}: {got} != {want}"
