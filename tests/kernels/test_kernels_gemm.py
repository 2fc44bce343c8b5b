"""The Triton linear kernel (dense, W8A16, W4A16) against its references: the int4 word layout
against a decoder written here from the layout's definition, the kernel against the fp32
dequantize-then-matmul reference and against the engine's unpacked-layout dequantizer, the
packed checkpoint formats through the kernel inside our model, and the tuning-table lookup.
Small cases run under TRITON_INTERPRET=1 on CPU (CI); `pytest -m gpu` adds real shapes."""

from __future__ import annotations

import json

import pytest
import torch

triton = pytest.importorskip("triton")

from llmaccel.kernels import gemm_tuning  # noqa: E402
from llmaccel.kernels.gemm import (  # noqa: E402
    GemmConfig,
    linear_ref,
    pack_int4_rows,
    packed_linear,
    prepare_packed_weight,
    triton_linear,
)
from llmaccel.kernels.gemv_fp8 import GemvFp8Config, valid_config
from llmaccel.kernels.gemv_w4 import GemvW4Config  # noqa: E402
from llmaccel.models.layers.linear_methods import dequantize_unpacked  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMA1 = GemmConfig(1, 16, 32, use_dot=False)
FMA4 = GemmConfig(4, 8, 64, use_dot=False)
DOT = GemmConfig(16, 16, 32, use_dot=True)
DOT_WIDE_K = GemmConfig(16, 32, 64, use_dot=True)  # BLOCK_K 64 spans two groups of 32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _quantized(n: int, k: int, bits: int, group: int, with_zeros: bool, seed: int = 0):
    g = _gen(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    n_groups = 1 if group == -1 else k // group
    scales = torch.rand(n_groups * n, generator=g).reshape(n, n_groups) + 0.05
    zeros = (torch.randint(0, 2**bits, (n, n_groups), generator=g, dtype=torch.uint8)
             if with_zeros else None)
    return codes, scales, zeros


def _dequant_independent(codes, scales, zeros, bits, group):
    """w[n, k] = (code - zero[n, k // group]) * scale[n, k // group], element by element."""
    n, k = codes.shape
    group = k if group == -1 else group
    out = torch.empty(n, k, dtype=torch.float64)
    for i in range(n):
        for j in range(k):
            z = (1 << (bits - 1)) if zeros is None else int(zeros[i, j // group])
            out[i, j] = (int(codes[i, j]) - z) * float(scales[i, j // group])
    return out


def test_int4_words_hold_eight_codes_lowest_nibble_first():
    codes = torch.randint(0, 16, (3, 16), generator=_gen(1), dtype=torch.uint8)
    words = pack_int4_rows(codes)
    assert words.dtype == torch.int32 and words.shape == (3, 2)
    for r in range(3):
        for w in range(2):
            u = int(words[r, w]) & 0xFFFFFFFF  # the word's 32 bits, unsigned
            decoded = [(u >> (4 * i)) & 0xF for i in range(8)]
            assert decoded == codes[r, 8 * w:8 * w + 8].tolist()


@pytest.mark.parametrize("bits,group,zeros", [(4, 32, True), (4, 16, False), (8, -1, False),
                                              (8, 32, True)])
def test_reference_matches_independent_dequantization(bits, group, zeros):
    codes, scales, z = _quantized(6, 64, bits, group, zeros)
    w = codes if bits == 8 else pack_int4_rows(codes)
    x = torch.eye(64, dtype=torch.float64).to(torch.float32)  # x = I reads W^T out
    got = linear_ref(x, w, bits, scales, z, group)
    want = _dequant_independent(codes, scales, z, bits, group).t().to(torch.float32)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


CASES = [  # (m, n, k, bits, group, zeros, config)
    (1, 40, 64, 16, -1, False, FMA1),
    (3, 24, 96, 16, -1, False, DOT),
    (1, 33, 64, 4, 32, True, FMA1),
    (5, 33, 128, 4, 32, True, DOT_WIDE_K),
    (3, 16, 64, 4, 64, False, FMA4),
    (17, 20, 64, 8, -1, False, DOT),
    (2, 24, 64, 8, 16, True, DOT_WIDE_K),
    (4, 16, 64, 4, 32, True, None),  # pick_config's own choice
    (1, 20, 192, 8, 192, False, None),  # its W8A16 decode tile: 4 rows, K in one 128 tile
    (2, 20, 96, 8, 32, True, None),  # ... grouped, a tile per group
]


@pytest.mark.parametrize("m,n,k,bits,group,zeros,cfg", CASES)
def test_kernel_matches_reference(m, n, k, bits, group, zeros, cfg):
    g = _gen(m * 100 + n)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    if bits == 16:
        w, s, z = torch.randn(n, k, generator=g).to(DEVICE), None, None
    else:
        codes, s, z = _quantized(n, k, bits, group, zeros, seed=m)
        w = codes if bits == 8 else pack_int4_rows(codes)
        w, s = w.to(DEVICE), s.to(DEVICE)
        z = None if z is None else z.to(DEVICE)
    got = triton_linear(x, w, bits, s, z, group, bias, cfg)
    want = linear_ref(x, w, bits, s, z, group, bias)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_act_order_layout_matches_unpacked_dequantizer():
    """GPTQ act-order: groups follow a permutation of the input channels. The kernel layout
    sorts the channels once and permutes x per call; its product equals the engine's
    reference dequantizer on the unpacked layout."""
    n, k, group, bits = 24, 64, 16, 4
    codes, scales, zeros = _quantized(n, k, bits, group, True, seed=3)
    perm = torch.randperm(k, generator=_gen(4))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group
    pw = prepare_packed_weight(codes, scales, zeros.to(torch.int32), g_idx, bits,
                               torch.float32)
    assert pw is not None and pw.perm is not None
    x = torch.randn(3, k, generator=_gen(5))
    want = x @ dequantize_unpacked(codes, scales, zeros.to(torch.int32), g_idx[None], [n],
                                   torch.float32).t()
    got = packed_linear(x.to(DEVICE), _to(pw, DEVICE), config=DOT).cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _to(pw, device):
    for name in ("weight", "scales", "zeros", "perm"):
        t = getattr(pw, name)
        if t is not None:
            setattr(pw, name, t.to(device))
    return pw


def test_prepare_refuses_groups_that_are_not_runs_and_drops_constant_zeros():
    codes, scales, zeros = _quantized(8, 64, 4, 16, True)
    g_idx = torch.arange(64) % 4  # 4 interleaved groups of 16 channels each
    g_idx[0] = 1  # now group 1 has 17 channels and group 0 has 15: no equal runs
    assert prepare_packed_weight(codes, scales, zeros.to(torch.int32), g_idx, 4,
                                 torch.float32) is None
    sym = torch.full((8, 4), 8, dtype=torch.int32)
    pw = prepare_packed_weight(codes, scales, sym, torch.arange(64) // 16, 4, torch.bfloat16)
    assert pw.zeros is None and pw.perm is None
    assert pw.scales.dtype == torch.float32  # rand() scales are not exact in bf16
    exact = scales.to(torch.bfloat16).float()
    pw = prepare_packed_weight(codes, exact, sym, torch.arange(64) // 16, 4, torch.bfloat16)
    assert pw.scales.dtype == torch.bfloat16


def test_bad_arguments_are_refused():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="bits"):
        triton_linear(x, torch.zeros(8, 64), bits=3)
    with pytest.raises(ValueError, match="does not fit"):
        triton_linear(x, torch.zeros(8, 32, dtype=torch.int32), bits=4,
                      scales=torch.ones(8, 2), group_size=32)
    with pytest.raises(ValueError, match="scales"):
        triton_linear(x, torch.zeros(8, 8, dtype=torch.int32), bits=4,
                      scales=torch.ones(8, 3), group_size=32)


def test_tuning_table_lookup(tmp_path, monkeypatch):
    cfg = {"block_m": 1, "block_n": 16, "block_k": 256, "use_dot": False, "num_warps": 4,
           "num_stages": 4}
    big = dict(cfg, block_m=16, use_dot=True)
    table = {"entries": {
        "16:1:3072:2048": {"backend": "triton", "config": cfg},
        "16:16:3072:2048": {"backend": "cublas", "config": big},
        "4:1:3072:2048": {"backend": "triton", "config": cfg},
        "4:16:3072:2048": {"backend": "triton", "config": big},
    }}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("LLMACCEL_GEMM_CONFIGS", str(path))
    gemm_tuning.clear_cache()
    try:
        assert gemm_tuning.dense_config(1, 3072, 2048) == GemmConfig(**cfg)
        assert gemm_tuning.dense_config(4, 3072, 2048) is None  # cuBLAS measured faster
        assert gemm_tuning.dense_config(1, 2048, 2048) is None  # untuned shape: cuBLAS
        # a Triton tile tuned for 16 rows is not borrowed for 2 (cuBLAS there)
        table["entries"]["16:16:3072:2048"]["backend"] = "triton"
        path.write_text(json.dumps(table))
        gemm_tuning.clear_cache()
        assert gemm_tuning.dense_config(16, 3072, 2048) == GemmConfig(**big)
        assert gemm_tuning.dense_config(2, 3072, 2048) is None
        # m=3 takes the next tuned bucket up (16); beyond the largest, the largest
        assert gemm_tuning.packed_config(3, 3072, 2048, 4, 128) == GemmConfig(**big)
        assert gemm_tuning.packed_config(500, 3072, 2048, 4, 128) == GemmConfig(**big)
        # untuned quantized shapes fall back to the heuristic
        assert gemm_tuning.packed_config(1, 64, 64, 4, 32).block_m == 1
    finally:
        gemm_tuning.clear_cache()


def test_shipped_tables_parse():
    for path in gemm_tuning.CONFIG_DIR.glob("*.json"):
        entries = json.loads(path.read_text())["entries"]
        for key, entry in entries.items():
            kind, bucket, n, k = key.split(":")
            bucket, n, k = int(bucket), int(n), int(k)
            assert bucket in gemm_tuning.M_BUCKETS and n > 0 and k > 0
            if kind == "w4cuda":
                # the batch-1 CUDA C int4 GEMV (kernels/gemv_w4_cuda.py)
                from llmaccel.kernels.gemv_w4_cuda import CudaGemvW4Config
                assert entry["backend"] == "cuda" and bucket == 1
                assert CudaGemvW4Config(**entry["config"]).fits(k), (key, entry)
                continue
            assert entry["backend"] in ("triton", "cublas")
            if kind == "w4gemv" or kind[2:] in gemm_tuning.FUSED_KINDS and kind[:2] == "w4":
                # the batch-1 W4A16 GEMV (kernels/gemv_w4.py), plain or fused
                assert bucket == 1
                GemvW4Config(**entry["config"])
                continue
            if kind == "fp8gemv" or kind[3:] in gemm_tuning.FUSED_KINDS and kind[:3] == "fp8":
                # the batch-1 FP8 W8A8 GEMV (kernels/gemv_fp8.py), plain or fused
                assert bucket == 1
                assert valid_config(GemvFp8Config(**entry["config"]))
                continue
            if kind.startswith("16") and kind != "16":  # fused decode GEMVs: 16norm/res/silu
                assert kind[2:] in gemm_tuning.FUSED_KINDS and bucket == 1
            else:
                assert int(kind) in (4, 8, 16)
            GemmConfig(**entry["config"])


@pytest.mark.parametrize("case", ["gptq-w4-asym-v1-actorder", "awq-w4-zp", "ct-w8-channel-bf16"])
def test_packed_checkpoint_through_kernel_matches_plain(case, tmp_path):
    """A packed checkpoint run through the Triton kernel layout inside our model gives the
    logits of the plain dequantized checkpoint (on CPU the kernel runs interpreted)."""
    from test_quant_loading import CASES as QCASES
    from test_quant_loading import LENGTHS, _logits, write_checkpoints

    from llmaccel.models.layers.linear import Linear
    from llmaccel.models.loader import load_model

    packed_dir, plain_dir = write_checkpoints(QCASES[case], tmp_path, family="llama")
    _, ours = load_model(str(packed_dir), dtype="float32", device="cpu")
    _, ref = load_model(str(plain_dir), dtype="float32", device="cpu")
    n_kernel = 0
    for module in ours.modules():
        if isinstance(module, Linear) and hasattr(module, "codes"):
            module.quant_method._prepare_kernel(module)
            module.use_triton = True
            # fused shards with different act-order permutations keep the reference path
            on_kernel = hasattr(module, "kernel_weight")
            n_kernel += on_kernel
            assert ("Triton W" in module.quant_method.describe(module)) == on_kernel
    assert n_kernel > 0
    seqs = [torch.randint(0, 160, (n,), generator=_gen(n)) for n in LENGTHS]
    torch.testing.assert_close(_logits(ours, seqs), _logits(ref, seqs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["gptq-w4-sym", "gptq-w4-asym-v1-actorder", "awq-w4-zp"])
def test_one_row_takes_the_w4_gemv_where_tuned(case, tmp_path, monkeypatch):
    """Batch-1 rows of int4 layers go through kernels/gemv_w4.py when the table has an entry
    for the shape (forced here; on CPU the kernel runs interpreted) and give the plain
    dequantized checkpoint's logits; the log names the GEMV."""
    from test_quant_loading import CASES as QCASES
    from test_quant_loading import write_checkpoints

    from llmaccel.kernels import gemv_w4
    from llmaccel.models.attention import AttentionMetadata
    from llmaccel.models.layers.linear import Linear
    from llmaccel.models.loader import load_model
    from llmaccel.models.layers import linear_methods

    monkeypatch.setattr(linear_methods, "_gemv_w4_config",
                        lambda layer, k, device: gemv_w4.GemvW4Config(8, 32, 2, 2))
    calls = []
    real = gemv_w4.w4a16_gemv
    monkeypatch.setattr(gemv_w4, "w4a16_gemv",
                        lambda *a, **kw: calls.append(kw.get("silu_out", False)) or real(*a, **kw))
    packed_dir, plain_dir = write_checkpoints(QCASES[case], tmp_path, family="llama")
    _, ours = load_model(str(packed_dir), dtype="float32", device="cpu")
    _, ref = load_model(str(plain_dir), dtype="float32", device="cpu")
    for module in ours.modules():
        if isinstance(module, Linear) and hasattr(module, "codes"):
            module.quant_method._prepare_kernel(module)
            module.use_triton = True
            if hasattr(module, "kernel_weight"):
                assert "gemv_w4.py" in module.quant_method.describe(module)
    def logits(model):  # one token: every linear sees one row
        meta = AttentionMetadata.for_prefill([1], "cpu")
        with torch.no_grad():
            return model.compute_logits(model(torch.tensor([7]), torch.tensor([0]), meta))

    torch.testing.assert_close(logits(ours), logits(ref), atol=1e-4, rtol=0)
    # every layer plain: the int4 method leaves SiLU-and-mul out of its GEMV (linear_methods)
    assert calls and True not in calls


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("cfg", [FMA1, DOT, GemmConfig(16, 16, 128, use_dot=True)])
def test_fp16_activations(bits, cfg):
    """fp16 activations and scales, tiles within one group and (BLOCK_K 128 > group 64)
    spanning two. (Triton's interpreter miscomputes bf16 tl.dot, so bf16 is checked on the
    GPU only.)"""
    m, n, k, group = 3, 24, 128, 64
    codes, s, z = _quantized(n, k, bits, group, True, seed=bits)
    w = codes if bits == 8 else pack_int4_rows(codes)
    x = torch.randn(m, k, generator=_gen(7)).to(torch.float16)
    s16 = (s * 0.05).to(torch.float16)
    got = triton_linear(x.to(DEVICE), w.to(DEVICE), bits, s16.to(DEVICE), z.to(DEVICE), group,
                        None, cfg).float().cpu()
    want = linear_ref(x.float(), w, bits, s16.float(), z, group)
    torch.testing.assert_close(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("bits,group,zeros", [(4, 32, True), (4, 128, False), (4, -1, True),
                                              (8, -1, False), (8, 64, True)])
def test_dequantize_packed_equals_the_reference_weight(bits, group, zeros):
    """The prefill path's weight (`dequantize_packed`) is, bit for bit, the weight linear_ref
    multiplies by: (code - zero) * scale in fp32, rounded once. fp16 on the CPU (the
    interpreter truncates to bf16), bf16 and fp16 on a GPU; N not a multiple of the tile."""
    from llmaccel.kernels.gemm import dequantize_packed

    n, k = 70, 256
    codes, s, z = _quantized(n, k, bits, group, zeros, seed=bits + k)
    w = codes if bits == 8 else pack_int4_rows(codes)
    s = s * 0.01
    for dtype in ((torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float16,)):
        got = dequantize_packed(w.to(DEVICE), bits, s.to(DEVICE), None if z is None else
                                z.to(DEVICE), group, dtype).cpu()
        want = linear_ref(torch.eye(k), w, bits, s, z, group).t().to(dtype)
        assert torch.equal(got, want), dtype
    with pytest.raises(ValueError, match="scales"):
        dequantize_packed(w, bits, s[:, :1] if s.shape[1] > 1 else s[:1], None, group,
                          torch.float16)


# ------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [(1, 3072, 2048), (7, 2048, 8192), (16, 5000, 1536), (200, 1152, 896)]


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernel_matches_reference(bits, dtype):
    group = -1 if bits != 4 else 128
    for m, n, k in GPU_SHAPES:
        g = _gen(m)
        x = torch.randn(m, k, generator=g).to("cuda", dtype)
        if bits == 16:
            w = (torch.randn(n, k, generator=g) * 0.02).to("cuda", dtype)
            s = z = None
        else:
            codes, s, z = _quantized(n, k, bits, group, True, seed=m)
            w = (codes if bits == 8 else pack_int4_rows(codes)).cuda()
            s, z = (s * 0.01).to("cuda", dtype), z.cuda()
        want = linear_ref(x.float(), w.float() if bits == 16 else w, bits,
                          None if s is None else s.float(), z, group)
        for cfg in (None, GemmConfig(1 if m == 1 else 16, 16, 256, use_dot=m > 1),
                    GemmConfig(64, 64, 64, True)):
            got = triton_linear(x, w, bits, s, z, group, None, cfg).float()
            err = (got - want).abs().max().item()
            scale = want.abs().max().item()
            assert err <= 2e-2 * scale, (m, n, k, cfg, err, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gptq-w4-sym", "gptq-w4-asym-v1-actorder", "awq-w4-zp",
                                  "ct-w8-channel-bf16"])
def test_gpu_engine_loads_packed_with_kernel(case, tmp_path, caplog):
    import logging

    from test_quant_loading import CASES as QCASES
    from test_quant_loading import LENGTHS, write_checkpoints

    from llmaccel.models.attention import AttentionMetadata
    from llmaccel.models.loader import load_model

    packed_dir, plain_dir = write_checkpoints(QCASES[case], tmp_path, family="llama")
    with caplog.at_level(logging.INFO, logger="llmaccel.models.layers.quant_configs"):
        _, ours = load_model(str(packed_dir), dtype="float32", device="cuda")
    assert "Triton W" in caplog.text
    _, ref = load_model(str(plain_dir), dtype="float32", device="cuda")
    seqs = [torch.randint(0, 160, (n,), generator=_gen(n)).cuda() for n in LENGTHS]
    meta = AttentionMetadata.for_prefill(LENGTHS, "cuda")
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).cuda()
    with torch.no_grad():
        a = ours.compute_logits(ours(torch.cat(seqs), pos, meta))
        b = ref.compute_logits(ref(torch.cat(seqs), pos, meta))
    torch.testing.assert_close(a, b, atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_prefill_rows_take_dequantize_then_cublas(bits, monkeypatch):
    """From DEQUANT_GEMM_MIN_M rows a packed layer dequantizes and runs cuBLAS: its output is
    F.linear on the reference weight exactly, near the fused GEMM's; fewer rows keep the GEMM."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from llmaccel.kernels import gemm
    from llmaccel.models.layers import linear_methods as lm

    n, k, group = 384, 512, 128 if bits == 4 else -1
    codes, s, z = _quantized(n, k, bits, group, True, seed=11)
    w = (codes if bits == 8 else pack_int4_rows(codes)).cuda()
    s, z = (s * 0.01).to("cuda", torch.bfloat16), z.cuda()
    layer = SimpleNamespace(kernel_weight=w, kernel_scales=s, kernel_zeros=z,
                            kernel_group_size=group, kernel_perm=None, use_triton=True,
                            output_size=n, input_size=k)
    method = lm.GPTQLinearMethod(bits, group, False, "gptq")
    calls = []
    real = gemm.dequantize_packed
    monkeypatch.setattr(gemm, "dequantize_packed", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(lm, "DEQUANT_GEMM_MIN_M", {bits: 64})
    x = torch.randn(100, k, device="cuda", dtype=torch.bfloat16)
    got = method.apply(layer, x)
    assert calls == [1]
    ref_w = linear_ref(torch.eye(k, device="cuda"), w, bits, s.float(), z, group).t()
    assert torch.equal(got, F.linear(x, ref_w.to(torch.bfloat16)))
    monkeypatch.setattr(lm, "DEQUANT_GEMM_MIN_M", {bits: 0})
    fused = method.apply(layer, x)
    assert calls == [1]
    torch.testing.assert_close(got.float(), fused.float(), atol=2e-2 * got.abs().max().item(),
                               rtol=0)
