"""The batch-1 FP8 W8A8 GEMV (kernels/gemv_fp8.py) against `fp8_gemv_ref` (the unfused layers:
RMSNorm / SiLU-and-mul, `fp8_linear`'s fp32 reference product, the residual add): awkward
sizes (rows past the last tile, K not a multiple of the tile), bias, the fused prologues and the
residual epilogue, fp32/fp16/bf16 activations, the activation codes against
`quantize_fp8_per_token`, the PDL branch, the refused arguments. Small cases run under
TRITON_INTERPRET=1 on CPU (CI); `pytest -m gpu` checks the llama-3.2-3b shapes on the GPU.
Also the tuning-table lookup and the benchmark script's --quick run.

The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest even), so bf16
cases are compared within a few bf16 ulps; fp32 and fp16 ones (numpy rounds those correctly)
must match to fp32 summation order."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from llmaccel.kernels import gemm_tuning, gemv_fp8, pdl
from llmaccel.kernels.gemv_fp8 import (
    GemvFp8Config,
    default_gemv_fp8_config,
    fp8_gemv,
    fp8_gemv_ref,
    quantize_row_fp8,
    valid_config,
)
from llmaccel.quant.fp8 import MIN_ACT_SCALE, over_fp8_max, quantize_fp8_per_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fp8_gemv.py"
E4M3 = torch.float8_e4m3fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes over the whole range (subnormals too) and fp32 scales [N, 1]."""
    g = _gen(seed)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(E4M3)
    return w, torch.rand(n, 1, generator=g) * 0.01 + 1e-3


def _on(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


def _tol(dtype: torch.dtype, want: torch.Tensor) -> float:
    # bf16: a few ulps of the output, for the interpreter's truncating roundings (which also
    # flip the odd activation code); fp32/fp16: summation order only
    scale = want.float().abs().max().item()
    return (3e-2 if dtype == torch.bfloat16 else 1e-5) * scale


# ------------------------------------------------------------------------- the quantizer

@triton.jit
def _quantize_kernel(A, S, Out, n, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale = tl.load(S)
    rcp = tl.div_rn(tl.full((), 1.0, tl.float32), scale)
    a = tl.load(A + r, mask=r < n, other=0.0)
    tl.store(Out + r, gemv_fp8._quantize(a, scale, rcp), mask=r < n)


def _all_finite(dtype: torch.dtype) -> torch.Tensor:
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return every[torch.isfinite(every.float())]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantizer_divides_and_rounds_like_torch(dtype):
    """`_quantize` (reciprocal + one Markstein step, then the e4m3 grid by an fp32 addition)
    equals e4m3(a / scale) with torch's true division, ties to even, for every finite bf16 and
    fp16 value (random fp32 ones) of a row whose absmax gives the scale; scales include
    MIN_ACT_SCALE, powers of two and all-ones significands (1 / scale rounds the most)."""
    base = _all_finite(dtype) if dtype != torch.float32 else \
        torch.randn(1 << 16, generator=_gen(1)) * 10.0 ** torch.randint(-8, 4, (1 << 16,),
                                                                          generator=_gen(2))
    absmaxes = [448.0, 1.0, 3.0, 7.77, 1e-3, 1e-7, 60000.0, 2.0 ** -20,
                torch.nextafter(torch.tensor(448.0 * 8), torch.tensor(0.0)).item(),
                torch.nextafter(torch.tensor(448.0 / 32), torch.tensor(0.0)).item()]
    absmaxes += (torch.rand(6, generator=_gen(3)) * 100).tolist()
    mismatches = 0
    for absmax in absmaxes:
        scale = over_fp8_max(torch.tensor([absmax])).clamp_min_(MIN_ACT_SCALE)
        a = base[base.float().abs() <= absmax]
        if a.numel() == 0:
            continue
        out = torch.empty(a.numel())
        _quantize_kernel[(triton.cdiv(a.numel(), 8192),)](a, scale, out, a.numel(), BLOCK=8192)
        want = (a.float() / scale).to(E4M3).float()
        mismatches += int((out != want).sum())
    assert mismatches == 0


def _identity(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w = I in e4m3 with unit scales: y[n] = a_q[n] * s_a, one product per output."""
    return torch.eye(k).to(E4M3), torch.ones(k, 1)


def _row_with_ties(k: int, absmax: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A row of random values plus values lying exactly halfway between two e4m3 codes
    (normal and subnormal) after the division by absmax / 448, and the absmax itself."""
    unit = absmax / 448
    ties = torch.tensor([1.0625, -1.1875, 2.5 + 0.125, 15.5, 240.0, -416.0, 2 ** -10,
                         3 * 2 ** -10, -5 * 2 ** -10, 448.0]) * unit
    x = (torch.rand(k, generator=_gen(seed)) * 2 - 1) * absmax
    x[: ties.numel()] = ties
    return x.to(dtype).reshape(1, k)


@pytest.mark.parametrize("dtype,absmax", [(torch.float32, 448.0), (torch.float32, 3.3),
                                          (torch.float32, 1e-7),  # the MIN_ACT_SCALE floor
                                          (torch.bfloat16, 28.0), (torch.float16, 0.4375)])
def test_activation_codes_equal_quantize_fp8_per_token(dtype, absmax):
    """Identity weights expose the activation codes: y = e4m3(x / s) * s must be bitwise what
    `quantize_fp8_per_token` gives (its scale a power of two for the half dtypes, so the
    products are exact in them). K = 200: a K tail and rows past the last tile."""
    k = 200
    x = _row_with_ties(k, absmax, dtype, seed=k)
    w, s = _identity(k)
    got = fp8_gemv(*_on(x, w, s), config=GemvFp8Config(16, 64, 2, 2)).cpu()
    q, scale = quantize_fp8_per_token(x)
    want = q.float() * scale
    assert got.dtype == dtype and got.shape == (1, k)
    assert torch.equal(got.float(), want)
    if absmax == 1e-7:
        assert scale.item() == pytest.approx(MIN_ACT_SCALE)


@pytest.mark.parametrize("prologue", ["norm", "silu"])
def test_prologue_codes_equal_the_separate_layers(prologue):
    """The same bit-for-bit check through a prologue, in fp16 (which the interpreter rounds
    correctly): every rounding of RMSNorm / SiLU-and-mul must be where the separate layers have
    it, or some of the 512 codes come out one step off (dropping silu's rounding to fp16 does
    that on seeds 1 and 2)."""
    from llmaccel.kernels.activation import silu_and_mul_ref
    from llmaccel.kernels.rmsnorm import rms_norm_ref

    k = 512
    w, s = _identity(k)
    for seed in range(3):
        g = _gen(seed)
        x = (torch.randn(1, 2 * k, generator=g) * 2).half()
        nw = (torch.rand(k, generator=g) + 0.5).half()
        if prologue == "norm":
            x, a, kw = x[:, :k], rms_norm_ref(x[:, :k], nw, 1e-5), {"norm_weight": nw, "eps": 1e-5}
        else:
            a, kw = silu_and_mul_ref(x), {"silu": True}
        dev_kw = {key: _on(v)[0] if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
        got = fp8_gemv(*_on(x, w, s), config=GemvFp8Config(64, 512, 4, 2), **dev_kw).cpu()
        q, scale = quantize_fp8_per_token(a)
        assert torch.equal(got, (q.float() * scale).half()), seed


def test_all_zero_row():
    w, s = _weights(24, 64, seed=0)
    got = fp8_gemv(torch.zeros(64), w, s)
    assert got.shape == (24,) and torch.equal(got, torch.zeros(24))


# ------------------------------------------------------------------- against the reference

CASES = [  # n, k, dtype, bias, config (None: the default)
    (40, 200, torch.float32, False, GemvFp8Config(8, 64, 1, 2)),    # K tail, 5 row tiles
    (40, 256, torch.float32, True, GemvFp8Config(16, 128, 2, 3)),   # N tail
    (72, 256, torch.float16, True, GemvFp8Config(4, 256, 1, 2)),    # one K step
    (33, 96, torch.float32, False, GemvFp8Config(16, 512, 4, 3)),   # the tile overhangs K
    (72, 320, torch.bfloat16, True, GemvFp8Config(8, 128, 2, 3)),
    (24, 128, torch.bfloat16, False, None),
    (1, 64, torch.float16, False, None),
]


@pytest.mark.parametrize("n,k,dtype,bias,cfg", CASES)
def test_matches_reference(n, k, dtype, bias, cfg):
    w, s = _weights(n, k, seed=n + k)
    x = (torch.randn(1, k, generator=_gen(k)) * 3).to(dtype)
    b = torch.randn(n, generator=_gen(n)).to(dtype) if bias else None
    got = fp8_gemv(*_on(x, w, s, b), cfg)
    want = fp8_gemv_ref(x, w, s, b)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=_tol(dtype, want), rtol=0)


FUSED = [  # prologue, residual, bias, dtype, config
    ("norm", False, False, torch.float32, GemvFp8Config(8, 64, 1, 2)),
    ("norm", True, True, torch.float16, GemvFp8Config(16, 128, 2, 3)),   # K tail
    ("norm", False, True, torch.bfloat16, GemvFp8Config(8, 256, 2, 2)),
    ("silu", True, False, torch.float32, GemvFp8Config(4, 128, 1, 3)),    # the down projection
    ("silu", False, False, torch.float16, GemvFp8Config(8, 64, 2, 2)),
    ("silu", True, False, torch.bfloat16, None),
    (None, True, True, torch.float32, GemvFp8Config(8, 128, 1, 2)),       # o projection
    (None, True, False, torch.bfloat16, GemvFp8Config(16, 64, 1, 2)),
]


def _fused_case(prologue, with_residual, bias, dtype, n=40, k=192, seed=11):
    w, s = _weights(n, k, seed)
    g = _gen(seed + 1)
    x = (torch.randn(1, 2 * k if prologue == "silu" else k, generator=g) * 2).to(dtype)
    kw = {}
    if prologue == "norm":
        kw = {"norm_weight": (torch.rand(k, generator=g) + 0.5).to(dtype), "eps": 1e-5}
    elif prologue == "silu":
        kw = {"silu": True}
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    res = torch.randn(1, n, generator=g).to(dtype) if with_residual else None
    return x, w, s, b, kw, res


@pytest.mark.parametrize("prologue,with_residual,bias,dtype,cfg", FUSED)
def test_fused_variants_match_the_separate_layers(prologue, with_residual, bias, dtype, cfg):
    """RMSNorm or SiLU-and-mul in the prologue, the residual add in the epilogue: equal to the
    separate layers (`fp8_gemv_ref`), which round between steps exactly as the kernel does."""
    x, w, s, b, kw, res = _fused_case(prologue, with_residual, bias, dtype)
    want_res = None if res is None else res.clone()
    want = fp8_gemv_ref(x, w, s, b, residual=want_res, **kw)
    got_res = None if res is None else _on(res)[0]
    dev_kw = {key: _on(v)[0] if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
    got = fp8_gemv(*_on(x, w, s, b), cfg, residual=got_res, **dev_kw)
    if with_residual:
        assert got is got_res  # updated in place and returned
    tol = _tol(dtype, want)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=0)
    if prologue is not None:  # the prologue matters: without it the product is different
        plain = fp8_gemv_ref(x[:, :w.shape[1]], w, s, b)
        assert (plain.float() - fp8_gemv_ref(x, w, s, b, **kw).float()).abs().max() > 10 * tol


SILU_OUT = [  # n (= 2I), k, dtype, norm prologue, bias, config
    (48, 128, torch.float32, False, False, GemvFp8Config(8, 64, 1, 2)),
    (40, 192, torch.float16, True, True, GemvFp8Config(16, 128, 2, 3)),
    (6, 64, torch.float32, True, False, GemvFp8Config(8, 64, 1, 2)),  # one partial tile
    (72, 96, torch.bfloat16, False, True, None),
]


@pytest.mark.parametrize("n,k,dtype,norm,bias,cfg", SILU_OUT)
def test_silu_out_epilogue(n, k, dtype, norm, bias, cfg):
    """A [gate; up] layer with SiLU-and-mul in the epilogue (tile rows interleaved gate/up)
    equals the layer then silu_and_mul, rounded the same way."""
    x, w, s, b, kw, _ = _fused_case("norm" if norm else None, False, bias, dtype, n=n, k=k)
    want = fp8_gemv_ref(x, w, s, b, silu_out=True, **kw)
    dev_kw = {key: _on(v)[0] if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
    got = fp8_gemv(*_on(x, w, s, b), cfg, silu_out=True, **dev_kw)
    assert got.shape == (1, n // 2)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=_tol(dtype, want), rtol=0)
    with pytest.raises(ValueError, match="silu_out"):
        fp8_gemv(x, w[:-1], s[:-1], silu_out=True)  # odd N


@pytest.mark.parametrize("dtype,cfg", [(torch.float32, GemvFp8Config(8, 64, 1, 2)),
                                       (torch.float16, GemvFp8Config(16, 128, 2, 3)),
                                       (torch.bfloat16, None)])
def test_prequantized_row(dtype, cfg):
    """`quantize_row_fp8` gives quantize_fp8_per_token's codes and scale; the GEMV on them
    (`x_scale`) gives the reference product."""
    n, k = 40, 192
    w, s = _weights(n, k, seed=4)
    x = (torch.randn(1, k, generator=_gen(4)) * 3).to(dtype)
    q, scale = quantize_row_fp8(_on(x)[0])
    want_q, want_scale = quantize_fp8_per_token(x)
    assert q.dtype == dtype and torch.equal(q.cpu().float(), want_q.float().reshape(1, k))
    assert torch.equal(scale.cpu(), want_scale.reshape(1).float())
    b = torch.randn(n, generator=_gen(5)).to(dtype)
    got = fp8_gemv(q, *_on(w, s, b), cfg, x_scale=scale)
    want = fp8_gemv_ref(x, w, s, b)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=_tol(dtype, want), rtol=0)
    # a prequant tile quantizes the row itself first: the same result from the raw row
    cfg_q = GemvFp8Config(8, 64, 1, 2, prequant=True)
    torch.testing.assert_close(fp8_gemv(*_on(x, w, s, b), cfg_q).float().cpu(), want.float(),
                               atol=_tol(dtype, want), rtol=0)
    assert cfg_q.describe().endswith("-q")
    with pytest.raises(ValueError, match="x_scale"):
        fp8_gemv(q, *_on(w, s), x_scale=scale, norm_weight=_on(torch.ones(k, dtype=dtype))[0])


def test_pdl_branch(monkeypatch):
    """With PDL on, the first weight tile is loaded before the wait and consumed outside the
    loop. The interpreter has no griddepcontrol, so the two PDL calls become no-ops here; the
    rest of that branch runs as on the GPU."""

    @triton.jit
    def _noop(USE_PDL: tl.constexpr):
        pass

    monkeypatch.setattr(gemv_fp8, "pdl_wait", _noop)
    monkeypatch.setattr(gemv_fp8, "pdl_launch_dependents", _noop)
    monkeypatch.setattr(pdl, "launch_kwargs", dict)
    monkeypatch.setattr(pdl, "_enabled", True)
    for cfg in (GemvFp8Config(8, 64, 1, 2), GemvFp8Config(16, 256, 2, 3)):  # loop; one step
        x, w, s, b, kw, res = _fused_case("norm", True, True, torch.float32, k=200)
        want = fp8_gemv_ref(x, w, s, b, residual=res.clone(), **kw)
        got = fp8_gemv(x, w, s, b, cfg, residual=res, **kw)
        torch.testing.assert_close(got, want, atol=_tol(torch.float32, want), rtol=0)


def test_leading_dims_and_default_config():
    w, s = _weights(24, 128, seed=2)
    x = torch.randn(1, 1, 128, generator=_gen(2))
    got = fp8_gemv(x, w, s[:, 0])  # a [N] scale works too
    assert got.shape == (1, 1, 24)
    torch.testing.assert_close(got.reshape(1, 24), fp8_gemv_ref(x.reshape(1, 128), w, s),
                               atol=1e-4, rtol=0)
    assert fp8_gemv(x.reshape(128), w, s).shape == (24,)
    for n, k in ((5120, 3072), (3072, 8192), (2048, 2048), (40, 24)):
        cfg = default_gemv_fp8_config(n, k)
        assert valid_config(cfg) and cfg.block_k <= max(16, 2 * k)


def test_bad_arguments_are_refused():
    w, s = _weights(16, 64, seed=0)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="one row"):
        fp8_gemv(torch.randn(2, 64), w, s)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        fp8_gemv(x.double(), w, s)
    with pytest.raises(ValueError, match="weight"):
        fp8_gemv(x, w.float(), s)  # not e4m3
    with pytest.raises(ValueError, match="weight"):
        fp8_gemv(x[:, :32], w, s)  # K mismatch
    with pytest.raises(ValueError, match="weight"):
        fp8_gemv(x[:, :32], w[:, ::2], s)  # rows not contiguous
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_gemv(x, w, s.half())
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_gemv(x, w, s[:8])
    with pytest.raises(ValueError, match="bias"):
        fp8_gemv(x, w, s, torch.zeros(8))
    with pytest.raises(ValueError, match="bias"):
        fp8_gemv(x, w, s, torch.zeros(16, dtype=torch.bfloat16))  # not x's dtype
    with pytest.raises(ValueError, match="one prologue"):
        fp8_gemv(torch.randn(1, 128), w, s, norm_weight=torch.ones(64), silu=True)
    with pytest.raises(ValueError, match="odd"):
        fp8_gemv(torch.randn(1, 129), w, s, silu=True)
    with pytest.raises(ValueError, match="norm_weight"):
        fp8_gemv(x, w, s, norm_weight=torch.ones(32))
    with pytest.raises(ValueError, match="residual"):
        fp8_gemv(x, w, s, residual=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="residual"):
        fp8_gemv(x, w, s, residual=torch.zeros(1, 16, dtype=torch.float16))
    for bad in (GemvFp8Config(8, 8), GemvFp8Config(8, 96), GemvFp8Config(6, 64),
                GemvFp8Config(8, 64, 3), GemvFp8Config(8, 64, 4, 0)):
        with pytest.raises(ValueError, match="config"):
            fp8_gemv(x, w, s, config=bad)


def test_tuning_table_lookup(tmp_path, monkeypatch):
    cfg = {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 3}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"entries": {
        "fp8gemv:1:3072:2048": {"backend": "triton", "config": cfg, "us": 3.0},
        "fp8gemv:1:2048:8192": {"backend": "triton", "config": dict(cfg, block_k=8)},
        "w4gemv:1:1024:2048": {"backend": "triton", "config": {"block_n": 8, "block_k": 256}},
    }}))
    monkeypatch.setenv("LLMACCEL_GEMM_CONFIGS", str(path))
    gemm_tuning.clear_cache()
    try:
        assert gemm_tuning.gemv_fp8_config(3072, 2048) == GemvFp8Config(**cfg)
        assert gemm_tuning.gemv_fp8_config(2048, 8192) is None  # an unusable tile
        assert gemm_tuning.gemv_fp8_config(1024, 2048) is None  # a W4 entry is not an FP8 one
        assert gemm_tuning.gemv_fp8_config(2048, 2048) is None  # untuned shape
    finally:
        gemm_tuning.clear_cache()


def test_benchmark_quick_run(tmp_path, monkeypatch):
    """benchmarks/bench_fp8_gemv.py --quick end to end (tiny shapes, CPU interpreter off GPU).
    The interpreter's timings are meaningless, so a scripted timer decides who wins: per shape
    bf16, then the `_scaled_mm` path, then the three tiles. An entry only where the best tile
    beat the `_scaled_mm` path."""
    spec = importlib.util.spec_from_file_location("bench_fp8_gemv", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    times = iter([10.0, 8.0, 9.0, 4.0, 6.0,    # 40 x 256: the second tile, 2x faster
                  10.0, 3.0, 9.0, 4.0, 6.0])   # 72 x 128: slower than the baseline
    monkeypatch.setattr(mod, "time_cpu", lambda fn, copies, calls: next(times))
    jsonl, table = tmp_path / "fp8.jsonl", tmp_path / "table.json"
    assert mod.main(["--quick", "--out-jsonl", str(jsonl), "--out-table", str(table)]) == 0
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["config"]["n"], r["config"]["k"]) for r in recs] == [(40, 256), (72, 128)]
    assert all(r["workload"] == "fp8gemv" and r["config"]["tiles_timed"] == 3 for r in recs)
    assert [r["speedup_vs_scaled_mm"] for r in recs] == [2.0, 0.75]
    entries = json.loads(table.read_text())["entries"]
    assert list(entries) == ["fp8gemv:1:40:256"]
    assert GemvFp8Config(**entries["fp8gemv:1:40:256"]["config"]) == \
        mod.candidates(40, 256, quick=True)[1]


# ------------------------------------------------------------------------------------- GPU

LLAMA_3B = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["plain", "bias", "norm", "silu_residual", "residual"])
def test_gpu_llama_3b_shapes_bf16(variant):
    """bf16 on the GPU (where every rounding is to nearest even) at the llama-3.2-3b shapes,
    with and without PDL, against the reference; the identity case checks the activation codes
    bit for bit (the division and e4m3 rounding survive compilation)."""
    prologue = {"norm": "norm", "silu_residual": "silu"}.get(variant)
    for n, k in LLAMA_3B:
        x, w, s, b, kw, res = _fused_case(prologue, "residual" in variant, variant == "bias",
                                          torch.bfloat16, n=n, k=k, seed=n)
        x, w, s, b, res = _on(x, w, s, b, res)
        kw = {key: _on(v)[0] if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
        want = fp8_gemv_ref(x, w, s, b, residual=None if res is None else res.clone(), **kw)
        scale = want.float().abs().max().item()
        for cfg in (None, GemvFp8Config(8, 512, 4, 3), GemvFp8Config(2, 4096, 4, 2),
                    GemvFp8Config(4, 1024, 2, 3, prequant=True)):
            for use_pdl in (False, pdl.supported("cuda")):
                before = pdl.enabled()
                pdl.set_enabled(use_pdl)
                try:
                    got = fp8_gemv(x, w, s, b, cfg, residual=None if res is None else res.clone(),
                                   **kw).float()
                finally:
                    pdl.set_enabled(before)
                err = (got - want.float()).abs().max().item()
                assert err <= 1e-2 * scale, (n, k, variant, cfg, use_pdl, err, scale)
    k = 3072
    x = _row_with_ties(k, 3.3, torch.float32, seed=0).cuda()
    q, a_scale = quantize_fp8_per_token(x)
    w, s = _identity(k)
    assert torch.equal(fp8_gemv(x, w.cuda(), s.cuda()), q.float() * a_scale)
