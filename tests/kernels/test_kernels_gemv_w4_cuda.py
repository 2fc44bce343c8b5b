"""The CUDA C batch-1 W4A16 GEMV (`kernels/gemv_w4_cuda.py`, `kernels/csrc/gemv_w4.cu`).

CPU (CI): when it is chosen (never off CUDA, never for shapes it cannot take), its default
tiles, that its source compiles with NVRTC for sm_80 and sm_90 where an NVRTC library is
installed, and that the arithmetic of its MATH=1 variant (codes read as subnormal floats)
reproduces the dequantize-then-matmul reference, emulated bit for bit in PyTorch.
GPU (`pytest -m gpu`, on the device): every tile and variant against `gemm.linear_ref` on
awkward shapes, and a chain of PDL launches inside a CUDA graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cuda_graph_helpers import pdl_on, replay_in_graph
from nvrtc_helpers import use_nvrtc

from llmaccel.kernels import cuda_rtc
from llmaccel.kernels.gemm import linear_ref, pack_int4_rows
from llmaccel.kernels.gemv_w4_cuda import (CudaGemvW4Config, RopeCache, _source,
                                           default_config, supports, w4a16_gemv_cuda)
from llmaccel.models.layers import linear_methods


def _weights(n, k, group, zeros, dev, scale_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    ng = k // (k if group == -1 else group)
    scales = (torch.rand(n, ng, generator=g) * 0.02 + 0.001).to(scale_dtype)
    z = torch.randint(0, 16, (n, ng), generator=g, dtype=torch.uint8) if zeros else None
    w = pack_int4_rows(codes)
    return (w.to(dev), scales.to(dev), None if z is None else z.to(dev))


def test_default_tiles():
    assert default_config(3072, 3072) == CudaGemvW4Config(2, 1, 1)  # o of llama-3.2-3b
    assert default_config(16384, 3072) == CudaGemvW4Config(4, 1, 1)  # gate_up
    assert default_config(3072, 8192).threads(8192) == 256
    big = default_config(64, 131072)
    assert big.threads(131072) <= 1024 and big.chunks == 4
    assert CudaGemvW4Config(2, 1).threads(1536) == 64  # 48 chunks, rounded up to warps


def test_not_chosen_off_cuda_or_for_shapes_it_cannot_take(monkeypatch):
    w, s, _ = _weights(64, 256, 128, False, "cpu")
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not supports(x, w, s, None, 128)  # CPU tensors
    monkeypatch.setattr(cuda_rtc, "available", lambda device=None: True)
    fake = SimpleNamespace(is_cuda=True, numel=lambda: 256, shape=(1, 256),
                           dtype=torch.bfloat16, device=torch.device("cuda", 0))
    assert supports(fake, w, s, None, 128)
    assert not supports(fake, w, s, None, 64 + 16)  # group not a multiple of 32
    fp32 = SimpleNamespace(**{**fake.__dict__, "dtype": torch.float32})
    assert not supports(fp32, w, s, None, 128)
    two_rows = SimpleNamespace(**{**fake.__dict__, "numel": lambda: 512, "shape": (2, 256)})
    assert not supports(two_rows, w, s, None, 128)
    # the engine's switch: a CPU layer never takes it
    layer = SimpleNamespace(kernel_weight=w, kernel_scales=s, kernel_zeros=None,
                            kernel_group_size=128)
    assert not linear_methods._use_cuda_gemv(layer, x, None)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("LLMACCEL_CUDA_KERNELS", "0")
    assert not cuda_rtc.available()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_nvrtc(arch, monkeypatch):
    use_nvrtc(monkeypatch)
    for defines in ({"ROWS": 2, "CHUNKS": 1, "THREADS": 96, "X_BF16": 1, "SCALE_KIND": 0,
                     "HAS_ZEROS": 0, "HAS_BIAS": 0, "MATH": 0},
                    {"ROWS": 4, "CHUNKS": 2, "THREADS": 64, "X_BF16": 0, "SCALE_KIND": 2,
                     "HAS_ZEROS": 1, "HAS_BIAS": 1, "MATH": 1, "PROLOGUE": 2, "RESIDUAL": 1},
                    {"ROWS": 4, "CHUNKS": 1, "THREADS": 96, "X_BF16": 1, "SCALE_KIND": 0,
                     "HAS_ZEROS": 0, "HAS_BIAS": 0, "MATH": 1, "PROLOGUE": 1, "SILU_OUT": 1},
                    {"ROWS": 2, "CHUNKS": 1, "THREADS": 96, "X_BF16": 1, "SCALE_KIND": 0,
                     "HAS_ZEROS": 0, "HAS_BIAS": 1, "MATH": 1, "RESIDUAL": 1},
                    {"ROWS": 4, "CHUNKS": 1, "THREADS": 96, "X_BF16": 1, "SCALE_KIND": 0,
                     "HAS_ZEROS": 1, "HAS_BIAS": 1, "MATH": 1, "ROPE": 1, "HEAD_DIM": 128},
                    {"ROWS": 2, "CHUNKS": 1, "THREADS": 32, "X_BF16": 0, "SCALE_KIND": 1,
                     "HAS_ZEROS": 0, "HAS_BIAS": 0, "MATH": 0, "ROPE": 1, "HEAD_DIM": 64}):
        cubin = cuda_rtc.compile_cubin(_source()[0], "gemv_w4", arch, defines, _source()[1])
        assert cubin[:4] == b"\x7fELF"
    with pytest.raises(cuda_rtc.CudaRtcError, match="could not compile"):
        cuda_rtc.compile_cubin(*_source()[:1], "gemv_w4", arch, {"ROWS": 2},  # macros missing
                               _source()[1])


def test_min_blocks_bounds_the_kernel(monkeypatch):
    """A tile's min_blocks reaches ptxas as the kernel's launch bound (.minnctapersm), and
    only when asked: an unbounded kernel gets no such bound (its register use is ptxas's
    choice, which the default tiles were measured with)."""
    use_nvrtc(monkeypatch)
    defines = {"ROWS": 4, "CHUNKS": 1, "THREADS": 96, "X_BF16": 1, "SCALE_KIND": 2,
               "HAS_ZEROS": 0, "HAS_BIAS": 0, "MATH": 1, "ROPE": 1, "HEAD_DIM": 128}
    src, hdr = _source()
    bounded = cuda_rtc.compile_ptx(src, "gemv_w4", "sm_90", {**defines, "MIN_BLOCKS": 10}, hdr)
    assert ".minnctapersm 10" in bounded and ".maxntid 96" in bounded
    plain = cuda_rtc.compile_ptx(src, "gemv_w4", "sm_90", {**defines, "MIN_BLOCKS": 0}, hdr)
    assert ".minnctapersm" not in plain and ".maxntid 96" in plain
    cfg = CudaGemvW4Config(4, 1, 1, 10)
    assert cfg.describe() == "cuda-r4c1sb10" and cfg.fits(3072)
    assert not CudaGemvW4Config(4, 1, 1, 33).fits(3072)


def _emulate_math1(x, w, scales, zeros, group):
    """The MATH=1 kernel's arithmetic in fp32 PyTorch: per 32-code chunk, codes masked in
    place and read as (subnormal) floats times x * 2^(96 - 4p), scaled back by 2^53, minus
    zero * sum(x); then times the group's scale."""
    n, kw = w.shape
    k = kw * 8
    xf = x.reshape(k).float()
    shift = torch.tensor([0, 4, 8, 12, 16, 4, 8, 12], dtype=torch.int64)
    src = torch.stack([w.to(torch.int64) & 0xFFFFFFFF] * 5 + [(w.to(torch.int64) & 0xFFFFFFFF)
                                                              >> 16] * 3, -1)  # [n, kw, 8]
    masked = (src & (0xF << shift)).to(torch.int32)
    v = masked.view(torch.float32).reshape(n, k)  # code * 2^(shift - 149), subnormal
    e = shift.repeat(kw)
    xs = xf * torch.pow(2.0, (96 - e).float())
    prod = (v * xs).reshape(n, k // 32, 32).sum(-1, dtype=torch.float64).float()
    sx = xf.reshape(k // 32, 32).sum(-1)
    g = torch.arange(k // 32) * 32 // (k if group == -1 else group)
    z = zeros.float()[:, g] if zeros is not None else torch.full((n, k // 32), 8.0)
    d = prod * 2.0**53 - z * sx
    return (d * scales.float()[:, g]).sum(-1)


@pytest.mark.parametrize("zeros", [False, True])
def test_subnormal_code_arithmetic_matches_reference(zeros):
    torch.set_flush_denormal(False)
    n, k, group = 24, 256, 64
    w, s, z = _weights(n, k, group, zeros, "cpu", torch.float32, seed=3)
    x = torch.randn(1, k) * 3
    got = _emulate_math1(x, w, s, z, group)
    ref = linear_ref(x, w, 4, s, z, group).reshape(n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the codes really are subnormal and nonzero: a flushed emulation would be all zero
    assert got.abs().max() > 1e-3


gpu = pytest.mark.gpu

TILES = [CudaGemvW4Config(r, c, m, b) for r, c, m, b in
         ((1, 1, 0, 0), (2, 1, 0, 0), (3, 1, 1, 0), (4, 2, 0, 0), (8, 1, 1, 0), (16, 1, 0, 0),
          (4, 4, 1, 0), (4, 1, 1, 10), (6, 1, 1, 11), (4, 1, 1, 6))]


@gpu
@pytest.mark.parametrize("n,k,group", [(5120, 3072, 128), (37, 1536, 32), (130, 8960, 128),
                                       (3, 4096, -1), (1000, 96, 32)])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("cfg", TILES, ids=lambda c: c.describe())
def test_gpu_matches_reference(n, k, group, zeros, cfg):
    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    w, s, z = _weights(n, k, group, zeros, "cuda", seed=n + k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = linear_ref(x.float(), w, 4, s.float(), z, group)
    if cfg.threads(k) > 1024:
        pytest.skip("tile needs over 1024 threads")
    got = w4a16_gemv_cuda(x, w, s, z, group, config=cfg).float()
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert (got - ref).norm() / ref.norm() < 8e-3


@gpu
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float32),
                                               (torch.float16, torch.float32)])
def test_gpu_half_activations_bias_and_scale_kinds(dtype, scale_dtype):
    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    n, k, group = 300, 2048, 128
    w, s, z = _weights(n, k, group, True, "cuda", scale_dtype, seed=7)
    x = torch.randn(2, 1, k, device="cuda", dtype=dtype)[1:]  # leading dims, an offset view
    bias = torch.randn(n, device="cuda", dtype=dtype)
    ref = linear_ref(x.float(), w, 4, s.float(), z, group, bias.float())
    for m in (0, 1):
        got = w4a16_gemv_cuda(x, w, s, z, group, bias, CudaGemvW4Config(2, 1, m))
        assert got.shape == (1, 1, n) and got.dtype == dtype
        assert (got.float() - ref).norm() / ref.norm() < 8e-3


@gpu
def test_gpu_pdl_chain_in_a_graph():
    """Each GEMV reads the previous one's output: with PDL every launch starts early and must
    still wait for its input (a missing wait reads stale x and the chain drifts)."""
    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    with pdl_on():
        k = 2048
        layers = [_weights(k, k, 128, i % 2 == 1, "cuda", seed=i) for i in range(6)]
        x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

        def chain(impl):
            h = x0
            for i, (w, s, z) in enumerate(layers):
                h = impl(h, w, s, z)
                if i == 2:  # a torch (non-PDL) kernel in the middle
                    h = h / h.float().norm().clamp_min(1e-6).to(h.dtype) * 40
            return h

        ref = chain(lambda h, w, s, z: linear_ref(h.float(), w, 4, s.float(), z, 128)
                    .to(h.dtype))
        out = replay_in_graph(lambda: chain(lambda h, w, s, z: w4a16_gemv_cuda(h, w, s, z, 128)))
        assert (out.float() - ref.float()).norm() / ref.float().norm() < 3e-2


@gpu
@pytest.mark.parametrize("prologue,with_residual", [("norm", False), ("silu", True),
                                                    (None, True), ("norm", True)])
@pytest.mark.parametrize("cfg", [CudaGemvW4Config(2, 1, 1), CudaGemvW4Config(4, 2, 0),
                                 CudaGemvW4Config(6, 1, 1)], ids=lambda c: c.describe())
def test_gpu_fused_decode_variants_match_the_separate_ops(prologue, with_residual, cfg):
    """RMSNorm or SiLU-and-mul in the prologue, the residual add in the epilogue: equal to
    `gemm.fused_linear_ref` on the dequantized weight (which rounds between steps as the
    separate layers do), within bf16 rounding of near-equal values."""
    from llmaccel.kernels.gemm import fused_linear_ref

    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    n, k, group = 300, 3072, 128
    w, s, z = _weights(n, k, group, True, "cuda", seed=5)
    dq = linear_ref(torch.eye(k, device="cuda"), w, 4, s.float(), z, group).t().contiguous()
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(1, 2 * k if prologue == "silu" else k, device="cuda", generator=g) * 2
    x = x.to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    kw = {}
    if prologue == "norm":
        kw = {"norm_weight": (torch.rand(k, device="cuda", generator=g) + 0.5)
              .to(torch.bfloat16), "eps": 1e-5}
    elif prologue == "silu":
        kw = {"silu": True}
    res = (torch.randn(1, n, device="cuda", generator=g).to(torch.bfloat16) * 4
           if with_residual else None)
    want_res = None if res is None else res.clone()
    want = fused_linear_ref(x, dq.to(torch.float32), bias, residual=want_res, **kw)
    got = w4a16_gemv_cuda(x, w, s, z, group, bias, cfg, residual=res, **kw)
    if with_residual:
        assert got.data_ptr() == res.data_ptr()  # updated in place
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 5e-3
    if prologue is not None:  # the prologue matters
        plain = linear_ref(x[:, :k].float(), w, 4, s.float(), z, group, bias.float())
        assert (plain - want.float()).norm() / want.float().norm() > 0.05


def test_silu_out_not_taken_off_cuda():
    """The int4 method's SiLU epilogue hook gives None (two steps) where the CUDA GEMV does not
    run, and refuses bad calls before any launch."""
    w, s, _ = _weights(64, 256, 128, False, "cpu")
    layer = SimpleNamespace(kernel_weight=w, kernel_scales=s, kernel_zeros=None,
                            kernel_group_size=128, kernel_perm=None, output_size=64,
                            input_size=256)
    method = linear_methods.GPTQLinearMethod(4, 128, True, "gptq")
    assert method.apply_silu_out(layer, torch.randn(1, 256, dtype=torch.bfloat16), None) is None
    with pytest.raises(ValueError, match="silu_out needs an even N"):
        w4a16_gemv_cuda(torch.randn(1, 256, dtype=torch.bfloat16), w[:63], s[:63], None, 128,
                        silu_out=True)


@gpu
@pytest.mark.parametrize("cfg", [CudaGemvW4Config(2, 1, 1), CudaGemvW4Config(4, 1, 0),
                                 CudaGemvW4Config(6, 1, 1), CudaGemvW4Config(6, 1, 1, 11)],
                         ids=lambda c: c.describe())
@pytest.mark.parametrize("n_out", [1000, 3])
def test_gpu_silu_out_epilogue(cfg, n_out):
    """A [gate; up] layer with SiLU-and-mul in the epilogue equals the GEMV rounded to bf16,
    then silu_and_mul; the rows past the end of an odd tile are not written."""
    from llmaccel.kernels.activation import silu_and_mul_ref

    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    k, group = 1536, 128
    w, s, z = _weights(2 * n_out, k, group, True, "cuda", seed=n_out)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(2 * n_out, device="cuda", dtype=torch.bfloat16)
    prod = linear_ref(x.float(), w, 4, s.float(), z, group, bias.float()).to(torch.bfloat16)
    want = silu_and_mul_ref(prod).float()
    got = w4a16_gemv_cuda(x, w, s, z, group, bias, cfg, silu_out=True)
    assert got.shape == (1, n_out)
    assert (got.float() - want).norm() / want.norm() < 8e-3



def test_tuned_tile_from_the_table(tmp_path, monkeypatch):
    """A "w4cuda:1:N:K" entry of the GPU's table (bench_w4_cuda_gemv.py --out-table) wins over the
    default tile; one that does not fit K is ignored; other shapes keep the default."""
    import json

    from llmaccel.kernels import gemm_tuning
    from llmaccel.kernels.gemv_w4_cuda import tile_for

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"entries": {
        "w4cuda:1:3072:8192": {"config": {"rows": 6, "chunks": 1, "math": 1}},
        "w4cuda:1:3072:3072": {"config": {"rows": 16, "chunks": 4, "math": 1}}}}))
    monkeypatch.setenv("LLMACCEL_GEMM_CONFIGS", str(path))
    gemm_tuning.clear_cache()
    try:
        assert tile_for(3072, 8192) == (CudaGemvW4Config(6, 1, 1), True)
        assert tile_for(3072, 3072) == (default_config(3072, 3072), False)  # 64 > 16 registers
        assert tile_for(5120, 3072) == (default_config(5120, 3072), False)
    finally:
        gemm_tuning.clear_cache()


def test_probe_failure_turns_cuda_kernels_off(monkeypatch, caplog):
    """A probe kernel NVRTC or the driver refuses (e.g. code from an NVRTC newer than the
    driver) turns the CUDA C kernels off with a warning, instead of failing the first layer."""
    def refuse(*a, **kw):
        raise cuda_rtc.CudaRtcError("cuModuleLoadData failed: device kernel image is invalid")

    monkeypatch.setattr(cuda_rtc, "get_kernel", refuse)
    with caplog.at_level("WARNING"):
        assert cuda_rtc._probe.__wrapped__(0) is False
    assert "device kernel image is invalid" in caplog.text


def _rope_case(nq, nkv, hd, dev, dtype=torch.bfloat16, pos=37, slot=21, blocks=4, bs=16):
    """A qkv layer's inputs and a RopeCache over a random paged cache."""
    from llmaccel.models.layers.rotary import RotaryEmbedding

    n, k, group = (nq + 2 * nkv) * hd, 512, 128
    w, s, z = _weights(n, k, group, True, dev, seed=hd)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, k, generator=g).to(dev, dtype)
    bias = torch.randn(n, generator=g).to(dev, dtype)
    rot = RotaryEmbedding(hd, 256, {"rope_theta": 10000.0, "rope_type": "default"}).to(dev)
    kv = torch.randn(2, blocks, bs, nkv, hd, generator=g).to(dev, dtype)
    rope = RopeCache(torch.tensor([pos], device=dev), rot.cos_sin_cache, kv,
                     torch.tensor([slot], device=dev), nq, nkv, hd)
    return (w, s, z, group, bias), x, rope


def test_rope_epilogue_not_taken_off_cuda_and_checks_its_inputs():
    """The int4 method's rope hook gives None (GEMV, then rope) where the CUDA GEMV does not
    run; the epilogue's inputs are checked with errors that name the problem."""
    (w, s, z, group, bias), x, rope = _rope_case(4, 2, 64, "cpu")
    layer = SimpleNamespace(kernel_weight=w, kernel_scales=s, kernel_zeros=z,
                            kernel_group_size=group, kernel_perm=None, output_size=w.shape[0],
                            input_size=512)
    method = linear_methods.GPTQLinearMethod(4, 128, False, "gptq")
    assert method.apply_qkv_rope(layer, x, bias, rope) is None
    rope.check(x, w.shape[0])  # consistent: no error
    with pytest.raises(ValueError, match="not \\(q heads"):
        rope.check(x, w.shape[0] - 64)
    with pytest.raises(ValueError, match="kv_cache must be"):
        RopeCache(rope.positions, rope.cos_sin_cache, rope.kv_cache.float(), rope.slot_mapping,
                  4, 2, 64).check(x, w.shape[0])
    with pytest.raises(ValueError, match="positions must be one int64"):
        RopeCache(rope.positions.int(), rope.cos_sin_cache, rope.kv_cache, rope.slot_mapping,
                  4, 2, 64).check(x, w.shape[0])
    with pytest.raises(ValueError, match="the rope epilogue takes no"):
        w4a16_gemv_cuda(x, w, s, z, group, bias, silu_out=True, rope=rope)


def _exact_rotary_and_cache(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping,
                            k_scale=1.0, v_scale=1.0):
    """`rotary.rotary_and_cache` with the eager layer's rope (`rotary_embedding_ref`)."""
    from llmaccel.kernels.cache import reshape_and_cache
    from llmaccel.kernels.rotary import rotary_embedding_ref

    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    reshape_and_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q, k


@gpu
@pytest.mark.parametrize("nq,nkv,hd", [(24, 8, 128), (9, 3, 64), (2, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [None, CudaGemvW4Config(2, 1, 1), CudaGemvW4Config(6, 1, 0),
                                 CudaGemvW4Config(4, 1, 1, 10)],
                         ids=lambda c: "default" if c is None else c.describe())
def test_gpu_rope_epilogue_equals_gemv_then_rope_and_cache_write(nq, nkv, hd, dtype, cfg):
    """q and the cache after the fused qkv GEMV equal, bit for bit, the plain CUDA GEMV, then
    the eager layer's rope and the cache write, and the Triton `rotary_and_cache` (which
    needs FP fusion off for that); a padding slot (-1) writes nothing."""
    from llmaccel.kernels.rotary import rotary_and_cache

    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    (w, s, z, group, bias), x, rope = _rope_case(nq, nkv, hd, "cuda", dtype)
    if dtype == torch.float16:
        s = s.half()
    cache0 = rope.kv_cache.clone()
    qkv = w4a16_gemv_cuda(x, w, s, z, group, bias, cfg)
    tq, tk, tv = (t.clone() for t in qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1))
    q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)  # rotated in place below
    want_cache = cache0.clone()
    _exact_rotary_and_cache(rope.positions, q.view(1, nq, hd), k.view(1, nkv, hd),
                            v.view(1, nkv, hd), rope.cos_sin_cache, want_cache,
                            rope.slot_mapping)
    triton_cache = cache0.clone()
    rotary_and_cache(rope.positions, tq.view(1, nq, hd), tk.view(1, nkv, hd), tv.view(1, nkv, hd),
                     rope.cos_sin_cache, triton_cache, rope.slot_mapping)
    assert torch.equal(tq, q) and torch.equal(triton_cache, want_cache)
    got_q = w4a16_gemv_cuda(x, w, s, z, group, bias, cfg, rope=rope)
    assert got_q.shape == (1, nq * hd)
    assert torch.equal(got_q, q)
    assert torch.equal(rope.kv_cache, want_cache)
    assert not torch.equal(want_cache, cache0)  # the slot was written
    pad = RopeCache(rope.positions, rope.cos_sin_cache, cache0.clone(),
                    torch.tensor([-1], device="cuda"), nq, nkv, hd)
    assert torch.equal(w4a16_gemv_cuda(x, w, s, z, group, bias, cfg, rope=pad), q)
    assert torch.equal(pad.kv_cache, cache0)


@gpu
@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-1.5b"])
def test_gpu_engine_rope_epilogue_same_tokens(shape, monkeypatch):
    """Batch-1 decode through CUDA graphs on a dummy GPTQ int4 model: the qkv GEMV with rope and
    the cache write in its epilogue (taken on every layer) gives the same greedy tokens as the
    GEMV, then the Triton rope and cache write (Qwen2: with the qkv bias)."""
    from llmaccel import LLM, SamplingParams
    from llmaccel.models import transformer
    from llmaccel.quant.presets import preset_config

    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    taken = []
    real = linear_methods.PackedLinearMethod.apply_qkv_rope

    def spy(self, layer, x, bias, rope):
        q = real(self, layer, x, bias, rope)
        taken.append(q is not None)
        return q

    monkeypatch.setattr(linear_methods.PackedLinearMethod, "apply_qkv_rope", spy)
    tokens = {}
    real_qkv_rope = transformer.qkv_rope
    for fused in (True, False):
        # unfused: the GEMV, then rope and the cache write
        monkeypatch.setattr(transformer, "qkv_rope",
                            real_qkv_rope if fused else lambda layer, x, rope: None)
        llm = LLM(shape, load_format="dummy", dtype="bfloat16", max_model_len=512,
                  hf_overrides={"quantization_config": preset_config("gptq-int4-g128")},
                  skip_tokenizer_init=True, enable_prefix_caching=False,
                  cudagraph_capture_sizes=[1])
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        tokens[fused] = [list(llm.generate({"prompt_token_ids": [(17 * i + 5 * j) % 900 + 10
                                                                 for j in range(40)]},
                                           params)[0].outputs[0].token_ids) for i in range(3)]
        del llm
        torch.cuda.empty_cache()
        if fused:
            layers = 16 if shape == "llama-3.2-1b" else 28
            assert taken.count(True) >= layers  # every layer's capture took it
    assert tokens[True] == tokens[False]
