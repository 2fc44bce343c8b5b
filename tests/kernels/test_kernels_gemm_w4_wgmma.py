"""The wgmma W4A16 GEMM (`kernels/gemm_w4_wgmma.py`, `kernels/csrc/gemm_w4_wgmma.cu`).

CPU (CI): tile choice and validity, the generated wgmma header, that the source compiles with
NVRTC for sm_90a (and its PTX holds the wgmma, the proxy fence and the PDL wait), and the
kernel's data path emulated lane by lane: the byte-t pairs dequantized with the magic number and
scaled in bf16 must place exactly the reference's bf16 weights in wgmma's A fragment layout, and
the accumulator layout must put every product at its y element.
GPU (`pytest -m gpu`, an sm_90 GPU): tiles against `gemm.linear_ref` on awkward shapes (rows
past the tile, N not a multiple of the block, groups 64 / 128 / per channel, zeros, split K,
bias, fp16), and a PDL chain inside a CUDA graph.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from cuda_graph_helpers import pdl_on, replay_in_graph
from nvrtc_helpers import use_nvrtc

from llmaccel.kernels import cuda_rtc
from llmaccel.kernels.gemm import linear_ref, pack_int4_rows
from llmaccel.kernels.gemm_w4_wgmma import (WgmmaW4Config, _source, config_for, kernel_defines,
                                            kernel_headers, supports, w4a16_gemm_wgmma,
                                            wgmma_header)


def _weights(n, k, group, zeros, dev, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    ng = k // (k if group == -1 else group)
    scales = (torch.rand(n, ng, generator=g) * 0.02 + 0.001).to(dtype)
    z = torch.randint(0, 16, (n, ng), generator=g, dtype=torch.uint8) if zeros else None
    return pack_int4_rows(codes).to(dev), scales.to(dev), None if z is None else z.to(dev)


def test_tiles_by_rows_and_columns():
    # the H100 sweeps' winners on the llama-3.2-3b shapes (group 128)
    qkv, o, gate_up, down = (5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)
    assert config_for(64, *qkv, 128) == WgmmaW4Config(64, 1, 4, 1, ksteps=8)
    assert config_for(64, *o, 128) == WgmmaW4Config(64, 1, 4, 2, ksteps=8)
    assert config_for(64, *down, 128) == WgmmaW4Config(64, 1, 4, 2, ksteps=8)
    assert config_for(128, *qkv, 128) == WgmmaW4Config(128, 1, 4, 1, ksteps=8)
    assert config_for(128, *o, 128) == WgmmaW4Config(64, 1, 4, 1, ksteps=8)
    assert config_for(128, *gate_up, 128) == WgmmaW4Config(128, 2, 4, 1, ksteps=4)
    assert config_for(128, *down, 128) == WgmmaW4Config(64, 1, 4, 4, ksteps=8)
    assert config_for(256, *gate_up, 128) == WgmmaW4Config(256, 2, 4, 1, ksteps=4)
    assert config_for(128, *qkv, 64).block_k == 64  # a group of 64 needs 64 k a stage
    for m in (1, 16, 64, 100, 128, 256, 1024):
        for n, k in (qkv, o, gate_up, down, (576, 1536), (200, 1536)):
            for group in (-1, 64, 128):
                cfg = config_for(m, n, k, group)
                stages = k // cfg.block_k
                assert cfg.valid() and k % cfg.block_k == 0 and stages % cfg.splitk == 0
                if group != -1:
                    assert (stages // cfg.splitk) % max(1, group // cfg.block_k) == 0
    assert not WgmmaW4Config(264).valid() and not WgmmaW4Config(100).valid()
    assert not WgmmaW4Config(256, 2, 8).valid()  # shared memory
    assert WgmmaW4Config(128, 2, 4).shared_bytes() % 1024 == 0


def test_header_lists_every_accumulator():
    h = wgmma_header(128, True)
    assert "m64n128k16.f32.bf16.bf16" in h and '"+f"(d[63])' in h and "d[64]" not in h
    assert "{%64, %65, %66, %67}, %68, 1, 1, 1, 0;" in h
    assert "m64n64k16.f32.f16.f16" in wgmma_header(64, False)


def test_not_taken_off_sm90():
    fake = SimpleNamespace(is_cuda=False, dtype=torch.bfloat16, shape=(128, 256),
                           numel=lambda: 128 * 256, dim=lambda: 2)
    w, s, _ = _weights(64, 256, 64, False, "cpu")
    assert not supports(fake, w, s, None, 64)
    if not torch.cuda.is_available():
        x = torch.randn(128, 256, dtype=torch.bfloat16)
        assert not supports(x, w, s, None, 64)


@pytest.mark.parametrize("kind", [None, 2, 1], ids=["native", "fp32-scales", "fp16-scales"])
@pytest.mark.parametrize("cfg,bf16,zeros,bias,gs", [
    (WgmmaW4Config(128, 1, 4, 1), True, False, False, 2),
    (WgmmaW4Config(64, 2, 3, 2), True, True, True, 1),
    (WgmmaW4Config(256, 2, 4, 1), False, False, False, 0),
    (WgmmaW4Config(16, 1, 6, 4), False, True, True, 2),
    (WgmmaW4Config(64, 1, 4, 2, 1, False, 0, 8), True, True, False, 1),
    (WgmmaW4Config(128, 2, 3, 1, 2, True, 0, 16), True, False, True, 0),
    (WgmmaW4Config(64, 1, 4, 1, ksteps=8, split_scale=False), True, True, False, 1),
], ids=lambda v: v.describe() if isinstance(v, WgmmaW4Config) else str(v))
def test_source_compiles_with_nvrtc_for_sm90a(cfg, bf16, zeros, bias, gs, kind, monkeypatch):
    use_nvrtc(monkeypatch)
    src = _source()[0]
    defines = kernel_defines(cfg, bf16, zeros, bias, gs, kind)
    headers = kernel_headers(cfg, bf16)
    assert cuda_rtc.compile_cubin(src, "gemm_w4_wgmma", "sm_90a", defines, headers)[:4] \
        == b"\x7fELF"
    ptx = cuda_rtc.compile_ptx(src, "gemm_w4_wgmma", "sm_90a", defines, headers)
    dt = "bf16" if bf16 else "f16"
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.bm}k16.f32.{dt}.{dt}" in ptx
    assert ("fence.proxy.async.shared::cta" in ptx) == cfg.fence and "griddepcontrol.wait" in ptx
    native = kind is None or kind == (0 if bf16 else 1)
    # the exact fp32 scale path packs with one cvt
    assert (f"cvt.rn.{dt}x2.f32" in ptx) == (not native and not cfg.split_scale)


# ----------------------------------------------------------------- lane-by-lane emulation
def _bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _bits_bf16(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int64) & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()


def _pair(word: int, t: int, zero: float, scale_bits: int) -> tuple[float, float]:
    """The kernel's `pair`: prmt byte t, * 0x1001, mask | magic 128, fma (x1 - (128 + zero)),
    bf16 multiply by the scale, each as the hardware rounds (bf16 results)."""
    b = (word >> (8 * t)) & 0xFF
    y = (b * 0x1001) & 0xFFFFFFFF
    q = (y & 0x000F000F) | 0x43004300
    out = []
    for half in (q & 0xFFFF, q >> 16):
        v = _bits_bf16(torch.tensor(half)).item()  # 128 + code, exact
        d = torch.tensor(v - (128.0 + zero)).to(torch.bfloat16).float()  # exact
        s = _bits_bf16(torch.tensor(scale_bits)).item()
        out.append(torch.tensor(d.item() * s).to(torch.bfloat16).float().item())
    return out[0], out[1]


def _pair_f32(word: int, t: int, zero: float, scale: torch.Tensor) -> tuple[float, float]:
    """The kernel's `pair` for scales not in the activation dtype: each nibble as 2^23 + code
    (the high one in place, 2^23 + 16 code) in fp32, minus 2^23 + zero (+ 16 zero), times the
    scale (the high one times scale / 16), each an fp32 operation; cvt.rn to bf16."""
    b = (word >> (8 * t)) & 0xFF
    f32 = torch.float32
    s = scale.to(f32)
    as_f = (lambda bits: torch.tensor(bits, dtype=torch.int32).view(f32))
    lo = (as_f((b & 0x0F) | 0x4B000000) - torch.tensor(8388608.0 + zero, dtype=f32)) * s
    hi = (as_f((b & 0xF0) | 0x4B000000) - torch.tensor(8388608.0 + 16 * zero, dtype=f32)) \
        * (s * torch.tensor(0.0625, dtype=f32))
    return lo.to(torch.bfloat16).float().item(), hi.to(torch.bfloat16).float().item()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_emulated_fp32_scale_pairs_are_the_reference_weights(scale_dtype):
    """fp32 (or fp16) scales with bf16 activations: every byte's pair equals the reference's
    bf16 weight, (code - zero) * scale in fp32 rounded once."""
    g = torch.Generator().manual_seed(5)
    scales = (torch.rand(64, generator=g) * 0.02 + 0.001).to(scale_dtype)
    for i in range(64):
        zero = float(i % 16)
        for byte in range(256):
            lo, hi = _pair_f32(byte, 0, zero, scales[i])
            ref = ((torch.tensor([byte & 0xF, byte >> 4]) - zero).float()
                   * scales[i].float()).to(torch.bfloat16).float()
            assert (lo, hi) == (ref[0].item(), ref[1].item())


def _rne_bf16(x: float) -> float:
    """x (a float64, normal) rounded to bf16, to nearest even, in one step."""
    if x == 0:
        return 0.0
    m, e = math.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1
    return round(m * 256) / 256 * 2.0 ** e  # Python's round: half to even


def test_emulated_split_scale_pairs_are_within_an_ulp():
    """SCALE_SPLIT: (code - zero) * hi + bf16((code - zero) * lo), one rounding for the FMA,
    with hi + lo = the fp16 scale exactly: every weight within 1 ulp of the reference's
    (code - zero) * scale rounded once, and nearly all equal to it."""
    g = torch.Generator().manual_seed(9)
    scales = (torch.rand(256, generator=g) * 0.02 + 0.001).to(torch.float16).float()
    same = total = 0
    for s in scales.tolist():
        hi = _rne_bf16(s)
        lo = _rne_bf16(s - hi)
        assert hi + lo == s  # fp16's 11 bits fit in two bf16 mantissas
        for code in range(16):
            for zero in (0, 3, 8, 15):
                d = float(code - zero)
                got = _rne_bf16(d * hi + _rne_bf16(d * lo))
                ref = _rne_bf16(d * s)
                ulp = 2.0 ** (math.frexp(ref)[1] - 8) if ref else 0.0
                assert abs(got - ref) <= ulp
                same += got == ref
                total += 1
    assert same / total > 0.97


def test_emulated_fragments_give_the_reference_product():
    """One warpgroup, one stage of 64 k: the A registers each lane builds, placed where
    wgmma's m64k16 A fragment says they go, must be the reference's bf16 weights; the
    accumulator layout (the kernel's epilogue indexing) must then give y = x W^T."""
    n, k, group, bm = 64, 64, 64, 16
    w, s, z = _weights(n, k, group, True, "cpu", seed=3)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((w[:, :, None] >> shifts) & 0xF).reshape(n, k)
    # linear_ref's weight: (code - zero) * scale in fp32, rounded once to bf16
    w_ref = ((codes - z.to(torch.int32)).float() * s.float()).to(torch.bfloat16).float()
    words = w.to(torch.int64) & 0xFFFFFFFF  # [64, 8]
    sbits = _bf16_bits(s.float())
    a_mat = torch.full((n, k), float("nan"))
    for q in range(4):  # warps of the warpgroup
        for lane in range(32):
            g, t = lane // 4, lane % 4
            ra, rb = 16 * q + g, 16 * q + g + 8
            for j in range(4):  # k16 steps: words 2j, 2j + 1
                regs = [(ra, 2 * j, 0), (rb, 2 * j, 0), (ra, 2 * j + 1, 8), (rb, 2 * j + 1, 8)]
                for row, wi, koff in regs:
                    lo, hi = _pair(int(words[row, wi]), t, float(z[row, 0]),
                                   int(sbits[row, 0]))
                    # the m64k16 A fragment: a0 / a1 rows g / g + 8 at k 2t, 2t + 1; a2 / a3
                    # the same rows at k 2t + 8, 2t + 9 (of the k16 step)
                    a_mat[row, 16 * j + koff + 2 * t] = lo
                    a_mat[row, 16 * j + koff + 2 * t + 1] = hi
    assert torch.equal(a_mat, w_ref)
    x = torch.randn(bm, k, dtype=torch.bfloat16).float()
    d_full = a_mat @ x.T  # [64 weight rows, bm x rows]: the accumulator tile
    y = torch.full((bm, n), float("nan"))
    for q in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for i in range(bm // 2):  # the epilogue's d[i] -> (weight row, x row)
                c = 16 * q + g + 8 * ((i >> 1) & 1)
                r = 8 * (i >> 2) + 2 * t + (i & 1)
                y[r, c] = d_full[16 * q + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * t + i % 2]
    assert torch.allclose(y, x @ w_ref.T, atol=1e-5)


# ----------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


def _sm90_or_skip():
    if not (cuda_rtc.available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm_90 GPU with CUDA C kernels")


@gpu
@pytest.mark.parametrize("m", [1, 5, 64, 100, 128, 300])
@pytest.mark.parametrize("n,k,group", [(5120, 3072, 128), (200, 1536, 64), (72, 8960, 128),
                                       (64, 256, -1)])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("cfg", [None, WgmmaW4Config(64, 1, 4, 1), WgmmaW4Config(128, 2, 3, 1),
                                 WgmmaW4Config(256, 1, 4, 2), WgmmaW4Config(16, 2, 4, 1),
                                 WgmmaW4Config(128, 1, 4, 4), WgmmaW4Config(64, 1, 6, 2, 2),
                                 WgmmaW4Config(64, 1, 6, 1, 1, False),
                                 WgmmaW4Config(128, 2, 4, 2, 1, False),
                                 WgmmaW4Config(64, 1, 4, 1, 1, False, 0, 8),
                                 WgmmaW4Config(128, 2, 3, 2, 1, False, 0, 8),
                                 WgmmaW4Config(64, 1, 3, 1, 1, True, 0, 16)],
                         ids=lambda c: "default" if c is None else c.describe())
def test_gpu_matches_reference(m, n, k, group, zeros, cfg):
    _sm90_or_skip()
    w, s, z = _weights(n, k, group, zeros, "cuda", seed=n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if not supports(x, w, s, z, group, None, cfg):
        pytest.skip("K or the group does not split into this tile's parts")
    ref = linear_ref(x.float(), w, 4, s.float(), z, group)
    got = w4a16_gemm_wgmma(x, w, s, z, group, config=cfg).float()
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert (got - ref).norm() / ref.norm() < 8e-3
    assert ((got - ref).norm(dim=1) / ref.norm(dim=1)).max() < 1.6e-2  # every row


@gpu
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,group,zeros", [(128, 5120, 3072, 128, False),
                                               (100, 200, 1536, 64, True),
                                               (256, 3072, 8192, 128, True),
                                               (64, 64, 256, -1, False)])
def test_gpu_scales_not_in_the_activation_dtype(scale_dtype, m, n, k, group, zeros):
    """bf16 activations with fp32 scales (what the engine keeps where bf16 cannot hold them
    exactly) or fp16 scales (GPTQ's own): the fp32 dequantization path."""
    _sm90_or_skip()
    w, s, z = _weights(n, k, group, zeros, "cuda", scale_dtype, seed=m + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert supports(x, w, s, z, group)
    ref = linear_ref(x.float(), w, 4, s.float(), z, group)
    got = w4a16_gemm_wgmma(x, w, s, z, group).float()
    assert (got - ref).norm() / ref.norm() < 8e-3
    assert ((got - ref).norm(dim=1) / ref.norm(dim=1)).max() < 1.6e-2


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_activations_and_bias(dtype):
    _sm90_or_skip()
    n, k, group = 328, 2048, 128
    w, s, z = _weights(n, k, group, True, "cuda", dtype, seed=7)
    x = torch.randn(2, 140, k, device="cuda", dtype=dtype)[1:]  # leading dims, an offset view
    bias = torch.randn(n, device="cuda", dtype=dtype)
    ref = linear_ref(x.float(), w, 4, s.float(), z, group, bias.float())
    got = w4a16_gemm_wgmma(x, w, s, z, group, bias)
    assert got.shape == (1, 140, n) and got.dtype == dtype
    assert (got.float() - ref).norm() / ref.norm() < 8e-3


@gpu
def test_gpu_pdl_chain_in_a_graph():
    """Each GEMM reads the previous one's output: with PDL each launch starts early (its codes
    in flight) and must still wait for x."""
    _sm90_or_skip()
    with pdl_on():
        k = 2048
        layers = [_weights(k, k, 128, i % 2 == 1, "cuda", seed=i) for i in range(6)]
        x0 = torch.randn(128, k, device="cuda", dtype=torch.bfloat16)

        def chain(impl):
            h = x0
            for w, s, z in layers:
                h = impl(h, w, s, z)
                h = h / h.float().norm(dim=1, keepdim=True).clamp_min(1e-6).to(h.dtype) * 40
            return h

        ref = chain(lambda h, w, s, z: linear_ref(h.float(), w, 4, s.float(), z, 128)
                    .to(h.dtype))
        out = replay_in_graph(lambda: chain(
            lambda h, w, s, z: w4a16_gemm_wgmma(h, w, s, z, 128)))
        assert (out.float() - ref.float()).norm() / ref.float().norm() < 3e-2


def test_engine_takes_it_for_64_to_256_rows(monkeypatch):
    """`PackedLinearMethod` routes int4 products of 64-256 rows here where the kernel can run
    (checked once a layer), before the mma.sync GEMM; fewer rows keep that GEMM or the GEMV."""
    from llmaccel.kernels import gemm_w4_wgmma
    from llmaccel.models.layers import linear_methods

    calls = []

    def fake_supports(*args, **kwargs):
        calls.append(1)
        return True

    monkeypatch.setattr(gemm_w4_wgmma, "supports", fake_supports)
    layer = SimpleNamespace(kernel_weight=SimpleNamespace(is_cuda=True), kernel_scales=None,
                            kernel_zeros=None, kernel_group_size=128, output_size=5120)
    rows = [m for m in (1, 2, 63, 64, 128, 200, 256, 257, 1024)
            if linear_methods._use_w4_wgmma(layer, torch.empty(m, 8), None)]
    assert rows == [64, 128, 200, 256]
    assert len(calls) == 1  # decided once for the layer, dtype and bias
    monkeypatch.setattr(linear_methods, "W4_WGMMA_MAX_M", 0)  # an empty range: never
    assert not linear_methods._use_w4_wgmma(layer, torch.empty(128, 8), None)
