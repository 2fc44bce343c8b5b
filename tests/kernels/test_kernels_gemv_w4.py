"""The batch-1 W4A16 GEMV (kernels/gemv_w4.py) against the fp32 dequantize-then-matmul reference
(`gemm.linear_ref`): awkward sizes (rows past the last tile, K not a multiple of the tile, tiles
inside one group and across several), per-group and per-channel scales, with and without zero
points and bias, fp32/bf16/fp16 activations, and the refused arguments. Small cases run under
TRITON_INTERPRET=1 on CPU (CI); `pytest -m gpu` checks bf16 at the llama-3.2-3b shapes. Also
the tuning-table lookup and the benchmark script's --quick smoke run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from llmaccel.kernels import gemm_tuning
from llmaccel.kernels.gemm import linear_ref, pack_int4_rows
from llmaccel.kernels.gemv_w4 import (
    GemvW4Config,
    default_gemv_w4_config,
    w4a16_gemv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_w4_gemv.py"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(n: int, k: int, group: int, with_zeros: bool, seed: int = 0, bias: bool = False):
    g = _gen(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    n_groups = 1 if group == -1 else k // group
    scales = torch.rand(n, n_groups, generator=g) * 0.1 + 0.01
    zeros = (torch.randint(0, 16, (n, n_groups), generator=g, dtype=torch.uint8)
             if with_zeros else None)
    x = torch.randn(1, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return pack_int4_rows(codes), scales, zeros, x, b


def _to(*ts, dtype=None):
    return [None if t is None else t.to(DEVICE, dtype if t.is_floating_point() else None)
            for t in ts]


CASES = [  # n, k, group, zeros, bias, config (None: the default)
    (40, 64, 32, True, False, GemvW4Config(8, 32, 1, 2, 1)),
    (40, 128, 64, False, True, GemvW4Config(16, 64, 2, 3, 2)),
    (72, 384, 128, True, True, GemvW4Config(8, 128, 1, 2, 4)),
    (72, 384, 128, False, False, GemvW4Config(16, 256, 2, 2, 2)),  # 2 groups a tile, K tail
    (40, 384, 32, True, False, GemvW4Config(4, 128, 2, 3, 1)),     # 4 groups a tile
    (72, 128, -1, True, True, GemvW4Config(8, 64, 1, 2, 2)),       # per channel
    (40, 384, -1, False, False, GemvW4Config(2, 256, 1, 2, 1)),    # per channel, K tail
    (33, 384, 128, True, True, None),
    (1, 64, -1, False, False, None),
]


@pytest.mark.parametrize("n,k,group,zeros,bias,cfg", CASES)
def test_matches_reference_fp32(n, k, group, zeros, bias, cfg):
    w, s, z, x, b = _case(n, k, group, zeros, seed=n + k, bias=bias)
    w, s, z, x, b = _to(w, s, z, x, b)
    got = w4a16_gemv(x, w, s, z, group, b, cfg)
    want = linear_ref(x, w, 4, s, z, group, b)
    assert got.shape == (1, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [GemvW4Config(8, 64, 1, 2, 2), GemvW4Config(4, 256, 2, 3, 1)])
def test_half_activations_and_scales(dtype, cfg):
    """bf16/fp16 x, scales and bias; y in x's dtype. (The interpreter rounds bf16 by
    truncation, so tolerances are those of one bf16 rounding of the output.)"""
    n, k, group = 40, 256, 64
    w, s, z, x, b = _case(n, k, group, True, seed=5, bias=True)
    x, s, b = x.to(dtype), s.to(dtype), b.to(dtype)
    got = w4a16_gemv(*_to(x, w, s, z), group, _to(b)[0], cfg)
    assert got.dtype == dtype and got.shape == (1, n)
    want = linear_ref(x.float(), w, 4, s.float(), z, group, b.float())
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2 * want.abs().max().item(),
                               rtol=0)


def test_leading_dims_and_default_config():
    w, s, z, x, _ = _case(24, 128, 32, False, seed=2)
    got = w4a16_gemv(*_to(x.reshape(1, 1, 128), w, s, z), 32)
    assert got.shape == (1, 1, 24)
    torch.testing.assert_close(got.reshape(1, 24), linear_ref(*_to(x, w), 4, *_to(s, z), 32),
                               atol=1e-4, rtol=1e-4)
    cfg = default_gemv_w4_config(3072, 3072, 128)
    assert cfg.block_k % 128 == 0 or 128 % cfg.block_k == 0


SILU_OUT = [  # n (= 2I), k, group, zeros, bias, norm prologue, dtype, config
    (48, 128, 32, True, False, False, torch.float32, GemvW4Config(8, 64, 1, 2, 2)),
    (40, 384, 128, False, True, True, torch.float32, GemvW4Config(16, 256, 2, 3, 1)),  # K tail
    (6, 64, -1, True, True, False, torch.float32, GemvW4Config(8, 32, 1, 2, 1)),  # one tile
    (72, 256, 64, True, False, False, torch.bfloat16, None),
]


@pytest.mark.parametrize("n,k,group,zeros,bias,norm,dtype,cfg", SILU_OUT)
def test_silu_out_epilogue(n, k, group, zeros, bias, norm, dtype, cfg):
    """A [gate; up] layer with SiLU-and-mul in the epilogue (tile rows interleaved gate/up)
    equals the layer's product, rounded to x's dtype, then silu_and_mul."""
    from llmaccel.kernels.activation import silu_and_mul_ref
    from llmaccel.kernels.gemm import fused_linear_ref

    w, s, z, x, b = _case(n, k, group, zeros, seed=n + k, bias=bias)
    x = x.to(dtype)
    b = None if b is None else b.to(dtype)
    kw = {"norm_weight": (torch.rand(k, generator=_gen(3)) + 0.5).to(dtype),
          "eps": 1e-5} if norm else {}
    want = silu_and_mul_ref(fused_linear_ref(x, _dequant(w, s, z, group, k), b, **kw))
    dev = {key: _to(v)[0] if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
    got = w4a16_gemv(*_to(x, w, s, z), group, _to(b)[0], cfg, silu_out=True, **dev)
    assert got.shape == (1, n // 2) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=1e-4)
    with pytest.raises(ValueError, match="silu_out"):
        w4a16_gemv(*_to(x, w, s, z), group, _to(b)[0], cfg, silu_out=True,
                   residual=torch.zeros(1, n, dtype=dtype, device=DEVICE))


def _dequant(w, s, z, group, k):
    """The fp32 weight [N, K] that `linear_ref` multiplies by (its own unpacking)."""
    return linear_ref(torch.eye(k), w, 4, s.float(), z, group).t().contiguous()


FUSED = [  # prologue, residual, dtype, config
    ("norm", False, torch.float32, GemvW4Config(8, 64, 1, 2, 2)),
    ("norm", True, torch.bfloat16, GemvW4Config(16, 256, 2, 3, 1)),  # K tail, 2 groups a tile
    ("silu", True, torch.float32, GemvW4Config(4, 128, 2, 3, 4)),
    ("silu", False, torch.bfloat16, None),
    (None, True, torch.float32, GemvW4Config(8, 128, 1, 2, 2)),
]


@pytest.mark.parametrize("prologue,with_residual,dtype,cfg", FUSED)
def test_fused_decode_variants_match_the_separate_ops(prologue, with_residual, dtype, cfg):
    """RMSNorm or SiLU-and-mul in the prologue, the residual add in the epilogue: equal to the
    separate layers' ops (`gemm.fused_linear_ref` on the dequantized weight), which round
    between steps exactly as the kernel does."""
    from llmaccel.kernels.gemm import fused_linear_ref

    n, k, group = 40, 384, 128
    w, s, z, x, b = _case(n, k, group, True, seed=11, bias=True)
    g = _gen(12)
    if prologue == "silu":
        x = torch.randn(1, 2 * k, generator=g)
    x, b = x.to(dtype), b.to(dtype)
    kw = {}
    if prologue == "norm":
        kw = {"norm_weight": (torch.rand(k, generator=g) + 0.5).to(dtype), "eps": 1e-5}
    elif prologue == "silu":
        kw = {"silu": True}
    res = torch.randn(1, n, generator=g).to(dtype) if with_residual else None
    want_res = None if res is None else res.clone()
    want = fused_linear_ref(x, _dequant(w, s, z, group, k), b, residual=want_res, **kw)
    dev = {key: _to(v)[0] if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
    got_res = None if res is None else _to(res)[0]
    got = w4a16_gemv(*_to(x, w, s, z), group, _to(b)[0], cfg, residual=got_res, **dev)
    if with_residual:
        assert got.data_ptr() == got_res.data_ptr()  # updated in place
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=1e-4)
    # the prologue matters: without it the product is different
    if prologue is not None:
        plain = fused_linear_ref(x if prologue == "norm" else x[:, :k],
                                 _dequant(w, s, z, group, k), b)
        assert (plain.float() - want.float()).abs().max() > 10 * tol


def test_bad_arguments_are_refused():
    w, s, z, x, _ = _case(16, 128, 32, True)
    with pytest.raises(ValueError, match="one row"):
        w4a16_gemv(torch.randn(2, 128), w, s, z, 32)
    with pytest.raises(ValueError, match="int32"):
        w4a16_gemv(x, w.to(torch.int64), s, z, 32)
    with pytest.raises(ValueError, match="int32"):
        w4a16_gemv(x[:, :64], w, s, z, 32)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_gemv(x, w, s, z, 48)
    with pytest.raises(ValueError, match="scales"):
        w4a16_gemv(x, w, s[:, :2], None, 32)
    with pytest.raises(ValueError, match="zeros"):
        w4a16_gemv(x, w, s, z.to(torch.int32), 32)
    with pytest.raises(ValueError, match="bias"):
        w4a16_gemv(x, w, s, z, 32, torch.zeros(8))
    with pytest.raises(ValueError, match="one prologue"):
        w4a16_gemv(x, w, s, z, 32, norm_weight=torch.ones(128), silu=True)
    with pytest.raises(ValueError, match="norm_weight"):
        w4a16_gemv(x, w, s, z, 32, norm_weight=torch.ones(64))
    with pytest.raises(ValueError, match="residual"):
        w4a16_gemv(x, w, s, z, 32, residual=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="config"):
        w4a16_gemv(x, w, s, z, 32, config=GemvW4Config(8, 48, 1, 2))  # not a power of two
    with pytest.raises(ValueError, match="config"):
        w4a16_gemv(x, w, s, z, 32, config=GemvW4Config(8, 64, 1, 2, 3))
    with pytest.raises(ValueError, match="config"):  # 64 neither inside nor whole groups of 96
        w4a16_gemv(torch.randn(1, 192), torch.zeros(16, 24, dtype=torch.int32),
                   torch.ones(16, 2), None, 96, config=GemvW4Config(8, 64, 1, 2))


def test_fused_int4_entries_only_from_the_table(tmp_path, monkeypatch):
    """An int4 layer runs fused only with a "w4<kind>" entry (written by the tuner where the
    fused chain was faster); the plain GEMV's entry alone does not make it fuse."""
    cfg = {"block_n": 8, "block_k": 256, "num_warps": 2, "num_stages": 3, "vec": 2}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"entries": {
        "w4gemv:1:3072:2048": {"backend": "triton", "config": cfg, "us": 3.0},
        "w4norm:1:5120:2048": {"backend": "triton", "config": cfg, "chain_us": 9.0}}}))
    monkeypatch.setenv("LLMACCEL_GEMM_CONFIGS", str(path))
    gemm_tuning.clear_cache()
    try:
        assert gemm_tuning.fused_w4_config("norm", 5120, 2048, 128) == GemvW4Config(**cfg)
        assert gemm_tuning.fused_w4_config("res", 5120, 2048, 128) is None
        assert gemm_tuning.fused_w4_config("norm", 3072, 2048, 128) is None
        assert gemm_tuning.fused_w4_config("norm", 5120, 2048, 96) is None  # does not fit
        with pytest.raises(ValueError, match="fused kind"):
            gemm_tuning.fused_quant_key("w4", "gelu", 8, 8)
        with pytest.raises(ValueError, match="prefix"):
            gemm_tuning.fused_quant_key("w3", "norm", 8, 8)
    finally:
        gemm_tuning.clear_cache()


def test_tuning_table_lookup(tmp_path, monkeypatch):
    cfg = {"block_n": 8, "block_k": 256, "num_warps": 2, "num_stages": 3, "vec": 2}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"entries": {
        "w4gemv:1:3072:2048": {"backend": "triton", "config": cfg, "us": 3.0}}}))
    monkeypatch.setenv("LLMACCEL_GEMM_CONFIGS", str(path))
    gemm_tuning.clear_cache()
    try:
        assert gemm_tuning.gemv_w4_config(3072, 2048, 128) == GemvW4Config(**cfg)
        assert gemm_tuning.gemv_w4_config(3072, 2048, -1) == GemvW4Config(**cfg)
        assert gemm_tuning.gemv_w4_config(3072, 2048, 96) is None  # the tile does not fit
        assert gemm_tuning.gemv_w4_config(2048, 2048, 128) is None  # untuned shape
    finally:
        gemm_tuning.clear_cache()


@pytest.mark.slow  # ~1 min; the kernel tests cover the GEMV itself
def test_benchmark_quick_run(tmp_path):
    """benchmarks/bench_w4_gemv.py --quick end to end (tiny shapes, CPU interpreter off GPU)."""
    spec = importlib.util.spec_from_file_location("bench_w4_gemv", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    jsonl, table = tmp_path / "w4.jsonl", tmp_path / "table.json"
    assert mod.main(["--quick", "--out-jsonl", str(jsonl), "--out-table", str(table)]) == 0
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["config"]["n"], r["config"]["k"]) for r in recs] == [(40, 256), (72, 128)]
    assert all(r["workload"] == "w4gemv" and r["value"] > 0 and r["asym_us"] > 0 for r in recs)
    entries = json.loads(table.read_text())["entries"]
    # an entry only where the GEMV beat the general kernel (timings: interpreter here)
    faster = {f"w4gemv:1:{r['config']['n']}:{r['config']['k']}" for r in recs
              if r["speedup_vs_old"] > 1}
    assert set(entries) == faster
    for e in entries.values():
        GemvW4Config(**e["config"])


@pytest.mark.parametrize("case", ["gptq-w4-sym", "awq-w4-zp", "gptq-w4-asym-v1-actorder"])
def test_int4_model_decodes_through_fused_layers(case, tmp_path, monkeypatch):
    """A packed int4 checkpoint at batch 1 with fused decode layers on: each layer runs as four
    GEMVs with the norms, SiLU-and-mul and residual adds folded in (interpreted on CPU) and
    gives the plain dequantized checkpoint's logits. Act-order layers (input channels
    permuted) keep the unfused path."""
    from test_quant_loading import CASES as QCASES
    from test_quant_loading import write_checkpoints

    from llmaccel.kernels import gemv_w4
    from llmaccel.models.attention import AttentionMetadata
    from llmaccel.models.layers.linear import Linear
    from llmaccel.models.loader import load_model
    from llmaccel.models.transformer import DecoderLayer

    fusions = []
    real = gemv_w4.w4a16_gemv

    def spy(*a, **kw):
        fusions.append(tuple(sorted(k for k, v in kw.items() if v is not None and v is not False
                                    and k not in ("eps",))))
        return real(*a, **kw)

    monkeypatch.setattr(gemv_w4, "w4a16_gemv", spy)
    # fused only where the table has a tile for the fusion (none on CPU): one is forced here
    monkeypatch.setattr(gemm_tuning, "fused_w4_config",
                        lambda kind, n, k, group, device=None: GemvW4Config(8, 64, 2, 2))
    packed_dir, plain_dir = write_checkpoints(QCASES[case], tmp_path, family="llama")
    _, ours = load_model(str(packed_dir), dtype="float32", device="cpu")
    _, ref = load_model(str(plain_dir), dtype="float32", device="cpu")
    for module in ours.modules():
        if isinstance(module, Linear) and hasattr(module, "codes"):
            module.quant_method._prepare_kernel(module)
    ours.set_fused_kernels(True, fuse_decode=True)
    fused_calls = []
    original = DecoderLayer.forward_fused
    monkeypatch.setattr(DecoderLayer, "forward_fused",
                        lambda self, *a: fused_calls.append(1) or original(self, *a))

    def logits(model, token):
        meta = AttentionMetadata.for_prefill([1], "cpu")
        with torch.no_grad():
            return model.compute_logits(model(torch.tensor([token]), torch.tensor([0]), meta))

    for token in (7, 31):
        torch.testing.assert_close(logits(ours, token), logits(ref, token), atol=1e-4, rtol=0)
    n_layers = ours.config.num_hidden_layers
    if "actorder" in case:
        assert not fused_calls and ("norm_weight",) not in fusions
    else:
        assert len(fused_calls) == 2 * n_layers
        # per layer: qkv (norm), o (residual), gate_up (norm), down (silu + residual)
        assert fusions == [("norm_weight",), ("residual",), ("norm_weight",),
                           ("residual", "silu")] * (2 * n_layers)
        desc = ours.model.layers[0].mlp.down_proj.quant_method.describe(
            ours.model.layers[0].mlp.down_proj)
        assert "fused decode layers" in desc


# ------------------------------------------------------------------------------------- GPU

LLAMA_3B = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_zeros", [False, True])
def test_gpu_llama_3b_shapes_bf16(with_zeros):
    from llmaccel.kernels import pdl

    for n, k in LLAMA_3B:
        w, s, z, x, _ = _case(n, k, 128, with_zeros, seed=n)
        x, s = x.to("cuda", torch.bfloat16), (s * 0.1).to("cuda", torch.bfloat16)
        w, z = w.cuda(), None if z is None else z.cuda()
        want = linear_ref(x.float(), w, 4, s.float(), z, 128)
        scale = want.abs().max().item()
        for cfg in (None, GemvW4Config(4, 128, 1, 3, 4), GemvW4Config(16, 1024, 8, 2, 1)):
            for use_pdl in (False, pdl.supported("cuda")):
                before = pdl.enabled()
                pdl.set_enabled(use_pdl)
                try:
                    got = w4a16_gemv(x, w, s, z, 128, config=cfg).float()
                finally:
                    pdl.set_enabled(before)
                err = (got - want).abs().max().item()
                assert err <= 1e-2 * scale, (n, k, cfg, use_pdl, err, scale)
