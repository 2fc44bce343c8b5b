"""The tensor-core W4A16 GEMM (`kernels/gemm_w4_cuda.py`, `kernels/csrc/gemm_w4.cu`).

CPU (CI): tile choice and validity, when it is chosen (never off CUDA or for shapes it cannot
take), that the source compiles with NVRTC for sm_80 and sm_90, and the kernel's data path
emulated lane by lane: the relabeled k slots, the PRMT pairs of x, the magic-number nibbles and
the C fragment's scale columns, through the PTX definition of mma.m16n8k16's fragments, must
give the reference product.
GPU (`pytest -m gpu`): every default tile against `gemm.linear_ref` on awkward shapes (rows
past the tile, N not a multiple of the tile, groups 32 / 128 / per channel, zeros, bias, fp16),
and a PDL chain inside a CUDA graph.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch
from cuda_graph_helpers import pdl_on, replay_in_graph
from nvrtc_helpers import use_nvrtc

from llmaccel.kernels import cuda_rtc
from llmaccel.kernels.gemm import linear_ref, pack_int4_rows
from llmaccel.kernels.gemm_w4_cuda import (DEFAULT_CONFIGS, GemmW4Config, _source, config_for,
                                           supports, w4a16_gemm_cuda)


# the default tiles without LEAN (the .cu; the defaults before run 6), and split-K tiles
VARIANT_CONFIGS = tuple(GemmW4Config(c.wm, c.wn, c.mt, c.ntw, c.cps, c.stages, not c.lean)
                     for c in DEFAULT_CONFIGS) + (
    GemmW4Config(2, 2, 4, 4, 4, 3, True, 2), GemmW4Config(2, 2, 4, 4, 4, 3, False, 3),
    GemmW4Config(1, 4, 1, 1, 4, 6, True, 4))


def _weights(n, k, group, zeros, dev, scale_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    ng = k // (k if group == -1 else group)
    scales = (torch.rand(n, ng, generator=g) * 0.02 + 0.001).to(scale_dtype)
    z = torch.randint(0, 16, (n, ng), generator=g, dtype=torch.uint8) if zeros else None
    return pack_int4_rows(codes).to(dev), scales.to(dev), None if z is None else z.to(dev)


def test_tiles_by_rows_and_columns():
    from llmaccel.kernels.gemm_w4_cuda import DECODE_NARROW, DECODE_WIDE, SHORT, TALL

    # llama-3.2-3b: qkv 5120, o / down 3072, gate_up 16384 columns (the sweeps' winners)
    assert config_for(2, 3072) == DECODE_NARROW and config_for(16, 3072) == DECODE_NARROW
    # 16 x 32 would give qkv 160 blocks, more than one wave
    assert config_for(2, 5120) == DECODE_WIDE and config_for(16, 16384) == DECODE_WIDE
    assert config_for(128, 16384) == TALL[0] and config_for(64, 16384) == TALL[1]
    assert config_for(128, 5120) == SHORT and config_for(128, 3072) == SHORT
    assert config_for(256, 5120) == TALL[1] and config_for(17, 16384) == SHORT
    for cfg in DEFAULT_CONFIGS:
        assert cfg.valid() and cfg.threads == 128 and cfg.lean
    assert GemmW4Config(2, 2, 4, 4, cps=3).valid() is False
    assert not GemmW4Config(8, 8, 16, 4, stages=8).valid()  # shared memory


def test_split_k_takes_whole_stages_and_groups(monkeypatch):
    monkeypatch.setattr(cuda_rtc, "available", lambda device=None: True)
    fake = SimpleNamespace(is_cuda=True, numel=lambda: 128 * 3072, shape=(128, 3072),
                           dim=lambda: 2, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    w, s, _ = _weights(64, 3072, 128, False, "cpu")  # 24 stages of 128 k, one group each
    split = lambda n: GemmW4Config(2, 2, 4, 4, 4, 3, splitk=n)  # noqa: E731
    assert supports(fake, w, s, None, 128, config=split(3))
    assert not supports(fake, w, s, None, 128, config=split(5))  # 24 stages
    w2, s2, _ = _weights(64, 3072, 512, False, "cpu")  # groups of 4 stages
    assert supports(fake, w2, s2, None, 512, config=split(6))
    assert not supports(fake, w2, s2, None, 512, config=split(8))  # 3 stages a split
    assert split(3).describe().endswith("-split3")
    assert not GemmW4Config(1, 1, 1, 1, splitk=17).valid()
    # x, codes, and per stage one scale word a row (group 128, 64-k stages), then zeros too
    assert GemmW4Config(2, 2, 4, 4).shared_bytes(4) == 4 * (128 * 64 * 2 + 64 * 32 + 64 * 4)
    assert GemmW4Config(2, 2, 4, 4, cps=4).shared_bytes(1, True) == 4 * (
        128 * 128 * 2 + 64 * 64 + 2 * 64 * 4 * 4)
    assert GemmW4Config(2, 2, 4, 4).shared_bytes(0, True) == 4 * (128 * 64 * 2 + 64 * 32)
    assert not GemmW4Config(2, 2, 4, 4, cps=3).valid()
    assert not GemmW4Config(8, 8, 16, 4, stages=8).valid()  # shared memory


def test_not_chosen_off_cuda_or_for_shapes_it_cannot_take(monkeypatch):
    w, s, _ = _weights(64, 256, 128, False, "cpu")
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    assert not supports(x, w, s, None, 128)  # CPU tensors
    monkeypatch.setattr(cuda_rtc, "available", lambda device=None: True)
    fake = SimpleNamespace(is_cuda=True, numel=lambda: 2048, shape=(8, 256), dim=lambda: 2,
                           dtype=torch.bfloat16, device=torch.device("cuda", 0))
    assert supports(fake, w, s, None, 128)
    assert not supports(fake, w, s, None, 64 + 16)  # group not a multiple of 32
    assert not supports(SimpleNamespace(**{**fake.__dict__, "dtype": torch.float32}),
                        w, s, None, 128)
    w_odd, s_odd, _ = _weights(60, 256, 128, False, "cpu")  # N not a multiple of 8
    assert not supports(fake, w_odd, s_odd, None, 128)
    short = SimpleNamespace(**{**fake.__dict__, "shape": (8, 96), "numel": lambda: 768})
    w96, s96, _ = _weights(64, 96, 32, False, "cpu")  # K not a multiple of the 128-k stage
    assert not supports(short, w96, s96, None, 32)
    w7, s7, z7 = _weights(64, 896, 128, True, "cpu")  # 7 groups: zero rows not word-aligned
    seven = SimpleNamespace(**{**fake.__dict__, "shape": (8, 896), "numel": lambda: 7168})
    assert supports(seven, w7, s7.float(), None, 128, config=GemmW4Config(1, 4, 1, 2, 1))
    assert not supports(seven, w7, s7, None, 128, config=GemmW4Config(1, 4, 1, 2, 1))
    assert not supports(seven, w7, s7.float(), z7, 128, config=GemmW4Config(1, 4, 1, 2, 1))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_nvrtc(arch, monkeypatch):
    use_nvrtc(monkeypatch)
    src, headers = _source()
    for cfg in DEFAULT_CONFIGS + VARIANT_CONFIGS + (GemmW4Config(2, 2, 4, 2, cps=4, stages=3),
                                                 GemmW4Config(1, 4, 1, 2, cps=1, stages=6)):
        for xb, kind, zeros, gc in ((1, 0, 0, 4), (0, 1, 1, 1), (1, 2, 1, 0)):
            defines = {"WM": cfg.wm, "WN": cfg.wn, "MT": cfg.mt, "NTW": cfg.ntw,
                       "CPS": cfg.cps, "STAGES": cfg.stages, "X_BF16": xb,
                       "SCALE_KIND": kind, "HAS_ZEROS": zeros, "HAS_BIAS": zeros,
                       "GROUP_CHUNKS": gc, "LEAN": int(cfg.lean), "SPLITK": cfg.splitk}
            assert cuda_rtc.compile_cubin(src, "gemm_w4", arch, defines, headers)
    ptx = cuda_rtc.compile_ptx(src, "gemm_w4", arch, defines, headers)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert ("griddepcontrol.wait" in ptx) == (arch == "sm_90")


# ----------------------------------------------------------------- lane-by-lane emulation

def _bf16_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0] >> 16  # test values are bf16-exact


def _bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i = byte (sel nibble i) of {b, a}."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _halves(u: int) -> tuple[float, float]:
    return _bf16_value(u & 0xFFFF), _bf16_value(u >> 16)


def _emulate_tile(x, words, scales, zeros, group):
    """One m16 x n8 tile as the kernel computes it: x [16, K] bf16-exact floats, words [8,
    K/8] int32 codes, fp32 scales / int zeros [8, G]. Per 32-k chunk, every lane (g, t) builds
    its registers as the .cu does; the registers are placed into A [16, 16] and B [16, 8] by
    the PTX fragment layout of mma.m16n8k16 and multiplied; group sums are scaled as the C
    fragment's columns (2t, 2t + 1) say."""
    k = x.shape[1]
    acc = [[0.0] * 8 for _ in range(16)]
    part = [[0.0] * 8 for _ in range(16)]
    for chunk in range(k // 32):
        grp = chunk * 32 // group
        regs_a = {}
        regs_b = {}
        for lane in range(32):
            g, t = lane // 4, lane % 4
            w = int(words[g, chunk * 4 + t]) & 0xFFFFFFFF
            z = 8 if zeros is None else int(zeros[g, grp])
            pairs = []
            for i in range(4):  # dequant_word: (nibble i, nibble i + 4) | magic, minus 128 + z
                lo, hi = _halves(((w >> (4 * i)) & 0x000F000F) | 0x43004300)
                pairs.append((lo - (128 + z), hi - (128 + z)))
            regs_b[lane] = pairs
            rows = []
            for r in (g, g + 8):
                vals = [_bf16_bits(float(v)) for v in x[r, chunk * 32 + 8 * t:
                                                         chunk * 32 + 8 * t + 8]]
                u = [vals[2 * q] | (vals[2 * q + 1] << 16) for q in range(4)]  # a uint4
                rows.append([_halves(_prmt(u[0], u[2], 0x5410)), _halves(_prmt(u[0], u[2], 0x7632)),
                             _halves(_prmt(u[1], u[3], 0x5410)), _halves(_prmt(u[1], u[3], 0x7632))])
            regs_a[lane] = rows
        for m_idx, (p_a, p_b) in enumerate(((0, 1), (2, 3))):  # the chunk's two mmas
            a = [[0.0] * 16 for _ in range(16)]
            b = [[0.0] * 8 for _ in range(16)]
            for lane in range(32):
                g, t = lane // 4, lane % 4
                lo, hi = regs_a[lane]
                # A registers {R0, R1, R2, R3} = (row g, 2t..), (row g+8, 2t..), (row g, 2t+8..),
                # (row g+8, 2t+8..); the kernel passes (l04, h04, l15, h15) for mma 1
                for (row, col), val in (((g, 2 * t), lo[p_a]), ((g + 8, 2 * t), hi[p_a]),
                                        ((g, 2 * t + 8), lo[p_b]), ((g + 8, 2 * t + 8), hi[p_b])):
                    a[row][col], a[row][col + 1] = val
                # B registers {R0, R1} = (k 2t, 2t+1; n g), (k 2t+8, 2t+9; n g)
                b[2 * t][g], b[2 * t + 1][g] = regs_b[lane][2 * m_idx]
                b[2 * t + 8][g], b[2 * t + 9][g] = regs_b[lane][2 * m_idx + 1]
            for r in range(16):
                for c in range(8):
                    part[r][c] += sum(a[r][q] * b[q][c] for q in range(16))
        if (chunk + 1) * 32 % group == 0:
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for e, (r, c) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                            (g + 8, 2 * t + 1))):
                    acc[r][c] += part[r][c] * float(scales[c, grp])
            for r in range(16):
                for c in range(8):
                    part[r][c] = 0.0
    return torch.tensor(acc, dtype=torch.float64)


@pytest.mark.parametrize("zeros,group", [(False, 32), (True, 64)])
def test_lane_emulation_matches_reference(zeros, group):
    k = 128
    w, s, z = _weights(8, k, group, zeros, "cpu", torch.float32, seed=3)
    x = torch.randn(16, k).to(torch.bfloat16).to(torch.float64)
    got = _emulate_tile(x, w, s, z, group)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((w[:, :, None] >> shifts) & 0xF).reshape(8, k).to(torch.float64)
    gi = torch.arange(k) // group
    zz = 8.0 if z is None else z.to(torch.float64)[:, gi]
    ref = x @ ((codes - zz) * s.to(torch.float64)[:, gi]).T
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("m", [2, 16, 33, 128, 300])
@pytest.mark.parametrize("n,k,group", [(5120, 3072, 128), (200, 1536, 32), (72, 8960, 128),
                                       (64, 256, -1)])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("cfg", DEFAULT_CONFIGS + VARIANT_CONFIGS
                         + (GemmW4Config(2, 2, 4, 2, 4, 3),), ids=lambda c: c.describe())
def test_gpu_matches_reference(m, n, k, group, zeros, cfg):
    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    w, s, z = _weights(n, k, group, zeros, "cuda", seed=n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if not supports(x, w, s, z, group, None, cfg):
        pytest.skip("K is not a multiple of this tile's stage")
    ref = linear_ref(x.float(), w, 4, s.float(), z, group)
    got = w4a16_gemm_cuda(x, w, s, z, group, config=cfg).float()
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert (got - ref).norm() / ref.norm() < 8e-3
    assert ((got - ref).norm(dim=1) / ref.norm(dim=1)).max() < 1.6e-2  # every row


@gpu
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float32),
                                               (torch.float16, torch.float32)])
def test_gpu_half_activations_bias_and_scale_kinds(dtype, scale_dtype):
    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    n, k, group = 328, 2048, 128
    w, s, z = _weights(n, k, group, True, "cuda", scale_dtype, seed=7)
    x = torch.randn(2, 40, k, device="cuda", dtype=dtype)[1:]  # leading dims, an offset view
    bias = torch.randn(n, device="cuda", dtype=dtype)
    ref = linear_ref(x.float(), w, 4, s.float(), z, group, bias.float())
    got = w4a16_gemm_cuda(x, w, s, z, group, bias)
    assert got.shape == (1, 40, n) and got.dtype == dtype
    assert (got.float() - ref).norm() / ref.norm() < 8e-3


@gpu
def test_gpu_pdl_chain_in_a_graph():
    """Each GEMM reads the previous one's output: with PDL each launch starts early (its codes
    in flight) and must still wait for x."""
    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    with pdl_on():
        k = 2048
        layers = [_weights(k, k, 128, i % 2 == 1, "cuda", seed=i) for i in range(6)]
        x0 = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)

        def chain(impl):
            h = x0
            for i, (w, s, z) in enumerate(layers):
                h = impl(h, w, s, z)
                h = h / h.float().norm(dim=1, keepdim=True).clamp_min(1e-6).to(h.dtype) * 40
            return h

        ref = chain(lambda h, w, s, z: linear_ref(h.float(), w, 4, s.float(), z, 128)
                    .to(h.dtype))
        out = replay_in_graph(lambda: chain(lambda h, w, s, z: w4a16_gemm_cuda(h, w, s, z, 128)))
        assert (out.float() - ref.float()).norm() / ref.float().norm() < 3e-2


def test_engine_takes_it_for_2_to_128_rows(monkeypatch):
    """`PackedLinearMethod` routes 2-128-row int4 products here, not one row (the GEMV) nor
    more (dequantize + cuBLAS measured faster at 256 rows); layers of at most 8192 columns
    only up to 127 rows (dequantize + cuBLAS measured faster for them at 128)."""
    from llmaccel.kernels import gemm_w4_cuda
    from llmaccel.models.layers import linear_methods

    monkeypatch.setattr(gemm_w4_cuda, "supports", lambda *a, **k: True)

    def layer(n):
        return SimpleNamespace(kernel_weight=SimpleNamespace(is_cuda=True), kernel_scales=None,
                               kernel_zeros=None, kernel_group_size=128, output_size=n)

    wide, narrow = layer(16384), layer(5120)
    rows = [m for m in (1, 2, 16, 31, 32, 127, 128, 129) if
            linear_methods._use_w4_gemm(wide, torch.empty(m, 8), None)]
    assert rows == [2, 16, 31, 32, 127, 128]
    rows = [m for m in (1, 2, 64, 127, 128) if
            linear_methods._use_w4_gemm(narrow, torch.empty(m, 8), None)]
    assert rows == [2, 64, 127]
    layer = wide
    monkeypatch.setattr(linear_methods, "W4_GEMM_MAX_M", 1)  # an empty range: never
    assert not linear_methods._use_w4_gemm(layer, torch.empty(2, 8), None)


def test_refuses_what_it_cannot_take_with_a_clear_error():
    w, s, _ = _weights(64, 256, 128, False, "cpu")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot take x"):
        w4a16_gemm_cuda(x, w, s, None, 128)  # CPU tensors
    with pytest.raises(ValueError, match="not valid"):
        w4a16_gemm_cuda(x, w, s, None, 128, config=GemmW4Config(1, 4, 1, 2, cps=3))


def test_layer_log_names_the_gemm(monkeypatch):
    """The engine's per-layer kernel log says which rows take the GEMM (users of other
    engines cannot tell which kernel runs)."""
    from llmaccel.models.layers import linear_methods

    monkeypatch.setattr(linear_methods, "_cuda_gemv_available", lambda layer: False)
    monkeypatch.setattr(linear_methods, "_gemv_w4_config", lambda *a: None)
    monkeypatch.setattr(linear_methods, "_w4_gemm_available", lambda layer: True)
    method = linear_methods.GPTQLinearMethod(4, 128, True, "gptq")
    layer = SimpleNamespace(kernel_weight=torch.zeros(1), kernel_perm=None, use_triton=True,
                            input_size=256, output_size=64)
    monkeypatch.setattr(method, "fused_decode_config", lambda *a: None)
    text = method.describe(layer)
    assert "2-127 rows: CUDA C tensor-core W4A16 GEMM" in text  # a narrow layer
    assert "from 128 rows: dequantize" in text
    layer.output_size = 16384
    text = method.describe(layer)
    assert "2-128 rows: CUDA C tensor-core W4A16 GEMM" in text
    assert "from 129 rows: dequantize" in text
