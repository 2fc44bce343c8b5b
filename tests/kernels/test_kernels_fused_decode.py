"""The fused decode path: GEMVs with an RMSNorm or SiLU-and-mul prologue and a residual-add
epilogue, rope + K/V cache write in one kernel, and a whole model decoding through them
against the unfused PyTorch reference. Small cases run under TRITON_INTERPRET=1 (CI);
`pytest -m gpu` runs real shapes in bf16/fp16 (the interpreter casts to bf16 by truncation,
so rounding is only checked there), with and without programmatic dependent launch (PDL), and
inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from llmaccel.kernels import pdl  # noqa: E402
from llmaccel.kernels.attention_ref import reshape_and_cache_ref  # noqa: E402
from llmaccel.kernels.gemm import GemmConfig, fused_linear_ref, triton_linear  # noqa: E402
from llmaccel.kernels.rotary import rotary_and_cache, rotary_embedding_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FMA = GemmConfig(1, 8, 32, use_dot=False)
FMA_WIDE = GemmConfig(2, 16, 64, use_dot=False)
DOT = GemmConfig(16, 16, 32, use_dot=True)


def _rand(*shape, dtype=torch.float32, device=DEVICE, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _case(m, n, k, dtype, kind, seed=0, bias=False):
    x = _rand(m, 2 * k if kind == "silu" else k, dtype=dtype, seed=seed)
    w = _rand(n, k, dtype=dtype, seed=seed + 1, scale=k ** -0.5)
    b = _rand(n, dtype=dtype, seed=seed + 2) if bias else None
    kw = {}
    if kind == "norm":
        kw = {"norm_weight": _rand(k, dtype=dtype, seed=seed + 3) + 1.0, "eps": 1e-5}
    elif kind == "silu":
        kw = {"silu": True}
    elif kind == "residual":
        kw = {"residual": _rand(m, n, dtype=dtype, seed=seed + 4)}
    return x, w, b, kw


def _check(m, n, k, dtype, kind, cfg, bias=False, tol=None):
    x, w, b, kw = _case(m, n, k, dtype, kind, bias=bias)
    ref_kw = dict(kw)
    if "residual" in kw:
        ref_kw["residual"] = kw["residual"].clone()
    want = fused_linear_ref(x.float() if dtype == torch.float32 else x, w, b, **ref_kw)
    got = triton_linear(x, w, 16, bias=b, config=cfg, **kw)
    if "residual" in kw:
        assert got.data_ptr() == kw["residual"].data_ptr()  # updated in place
    atol = tol or (1e-4 if dtype == torch.float32 else 3e-2)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["norm", "silu", "residual"])
@pytest.mark.parametrize("m,n,k,cfg", [(1, 24, 96, FMA), (3, 40, 80, FMA_WIDE), (5, 33, 64, DOT)])
def test_fused_gemv_variants_small(kind, m, n, k, cfg):
    _check(m, n, k, torch.float32, kind, cfg, bias=(n == 33))


def test_fused_gemv_rejects_bad_arguments():
    x, w, _, _ = _case(1, 8, 32, torch.float32, "none")
    with pytest.raises(ValueError, match="one prologue"):
        triton_linear(x, w, silu=True, norm_weight=torch.ones(32))
    with pytest.raises(ValueError, match="norm_weight must be"):
        triton_linear(x, w, norm_weight=torch.ones(31))
    with pytest.raises(ValueError, match="residual must be"):
        triton_linear(x, w, residual=torch.zeros(1, 9))


@pytest.mark.parametrize("fp8", [False, True])
def test_rotary_and_cache_equals_rope_then_cache_write(fp8):
    if fp8 and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    t, heads, kv_heads, d, block_size, blocks = 5, 6, 2, 16, 4, 6
    pos = torch.tensor([0, 3, 7, 2, 11])
    cos_sin = torch.cat([torch.cos(torch.outer(torch.arange(16.0), torch.rand(d // 2))),
                         torch.sin(torch.outer(torch.arange(16.0), torch.rand(d // 2)))], -1)
    qkv = _rand(t, (heads + 2 * kv_heads) * d, device="cpu")
    slots = torch.tensor([0, 5, -1, 13, 22])  # -1: a padding row writes nothing
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    cache = torch.zeros(2, blocks, block_size, kv_heads, d).to(cache_dtype)

    def split(buf):
        q, k, v = buf.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        return (q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d))

    ref_buf, got_buf = qkv.clone(), qkv.clone().to(DEVICE)
    rq, rk, rv = split(ref_buf)
    rotary_embedding_ref(pos, rq, rk, cos_sin)
    ref_cache = cache.clone()
    reshape_and_cache_ref(rk, rv, ref_cache, slots, 2.0 if fp8 else 1.0, 0.5 if fp8 else 1.0)
    gq, gk, gv = split(got_buf)
    got_cache = cache.clone().to(DEVICE)
    rotary_and_cache(pos.to(DEVICE), gq, gk, gv, cos_sin.to(DEVICE), got_cache,
                     slots.to(DEVICE), 2.0 if fp8 else 1.0, 0.5 if fp8 else 1.0)
    torch.testing.assert_close(got_buf.cpu(), ref_buf, atol=1e-5, rtol=0)  # q, k rotated
    torch.testing.assert_close(got_cache.cpu().float(), ref_cache.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fuse", [True, False])
def test_model_decode_fused_equals_torch_reference(fuse, tmp_path, monkeypatch):
    """A tiny Qwen2 (qkv bias), prefill then batched decode steps through the paged cache: the
    Triton path with the fused decode layers (interpreter on CPU) gives the logits of the
    torch reference, and the decode steps did run fused (two layers x three steps)."""
    from fused_decode_case import run_decode_case

    from llmaccel.models.transformer import DecoderLayer

    calls = []
    original = DecoderLayer.forward_fused

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward_fused", counted)
    got, want = run_decode_case(tmp_path, DEVICE, fuse=fuse)
    # prefill (17 tokens) is above FUSED_DECODE_MAX_ROWS; each decode step (3 rows) is not
    assert len(calls) == (2 * 3 if fuse else 0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=0)


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("kind,dtype", [("norm", torch.bfloat16), ("silu", torch.bfloat16),
                                        ("residual", torch.bfloat16), ("none", torch.bfloat16),
                                        ("norm", torch.float16), ("silu", torch.float16)])
@pytest.mark.parametrize("m,n,k", [(1, 2048, 8192), (5, 1000, 1536)])
def test_fused_gemv_gpu(use_pdl, dtype, kind, m, n, k):
    if use_pdl and not pdl.supported("cuda"):
        pytest.skip("PDL needs compute capability 9.0")
    pdl.set_enabled(use_pdl)
    try:
        from llmaccel.kernels.gemm import pick_config
        cfg = pick_config(m, n, k, 16, -1)
        # bf16/fp16 outputs of magnitude ~4: two steps of rounding apart at most
        _check(m, n, k, dtype, kind, cfg, bias=(n == 1000), tol=6e-2)
        if m == 1:  # the tuned H100 decode tile
            _check(m, n, k, dtype, kind, GemmConfig(1, 4, 1024, use_dot=False, num_stages=5),
                   tol=6e-2)
    finally:
        pdl.set_enabled(False)


@pytest.mark.gpu
@gpu
def test_pdl_chain_in_a_cuda_graph_matches_eager():
    """A chain of fused GEMVs, each reading the previous one's output, captured in a CUDA
    graph with PDL: the replayed result equals the plain launches' (a missing wait would
    read stale inputs)."""
    if not pdl.supported("cuda"):
        pytest.skip("PDL needs compute capability 9.0")
    m, h, inter = 1, 2048, 8192
    ws = [_rand(3 * h, h, dtype=torch.bfloat16, seed=s, scale=h ** -0.5) for s in range(4)]
    wo = [_rand(h, h, dtype=torch.bfloat16, seed=10 + s, scale=h ** -0.5) for s in range(4)]
    wgu = [_rand(2 * inter, h, dtype=torch.bfloat16, seed=20 + s, scale=h ** -0.5)
           for s in range(4)]
    wd = [_rand(h, inter, dtype=torch.bfloat16, seed=30 + s, scale=inter ** -0.5)
          for s in range(4)]
    nw = _rand(h, dtype=torch.bfloat16, seed=99) + 1.0
    x0 = _rand(m, h, dtype=torch.bfloat16, seed=123)

    def chain(res):
        for i in range(4):
            qkv = triton_linear(res, ws[i], norm_weight=nw, eps=1e-5)
            triton_linear(qkv[:, :h].contiguous(), wo[i], residual=res)
            gu = triton_linear(res, wgu[i], norm_weight=nw, eps=1e-5)
            triton_linear(gu, wd[i], silu=True, residual=res)
        return res

    pdl.set_enabled(False)
    want = chain(x0.clone())
    pdl.configure("cuda", requested=True)
    try:
        buf = x0.clone()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            chain(buf.clone())  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            chain(buf)
        for _ in range(3):
            buf.copy_(x0)
            graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(buf, want, atol=0, rtol=0)
    finally:
        pdl.set_enabled(False)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("use_pdl", [False, True])
def test_model_decode_fused_gpu(use_pdl, tmp_path):
    if use_pdl and not pdl.supported("cuda"):
        pytest.skip("PDL needs compute capability 9.0")
    from fused_decode_case import run_decode_case

    pdl.set_enabled(use_pdl)
    try:
        got, want = run_decode_case(tmp_path, "cuda", fuse=True)
    finally:
        pdl.set_enabled(False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=0)


def test_pdl_kernels_compile_for_hopper_and_wait_before_touching_data():
    """Every decode-graph kernel with USE_PDL compiles for sm_90 (Triton's ptxas, no GPU), and
    its PTX waits (griddepcontrol.wait) before any global store, and before any load except
    the GEMVs' weight prefetch and the decode attention's reads of step inputs and older K/V;
    launch_dependents comes after the wait."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "pdl_ptx_check.py"
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=600)
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 14, out.stderr[-2000:]
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
    assert all(r["loads_before_wait"] > 0 for r in results if r["kernel"].startswith("linear"))
    # the decode attention: its step inputs before the wait, then also the first tile's K and
    # V of earlier steps, when asked
    early = {r["kernel"]: r["loads_before_wait"] for r in results
             if r["kernel"].startswith("paged_decode")}
    assert (0 < early["paged_decode"] < early["paged_decode-early-kv"]
            < early["paged_decode-early-kv-tree"]), early
    # bf16 rope compiled as launched (no FP fusion) rounds each product: no FMA contraction
    rope = [r for r in results if r["kernel"] in ("rotary", "rotary_and_cache")]
    assert len(rope) == 2 and all(r["fma"] == 0 for r in rope), rope


def test_fused_table_entries_come_first_at_batch_one(tmp_path, monkeypatch):
    """A batch-1 fused entry (tune_fused_decode.py) is used for m == 1 of its kind only; other
    kinds fall back to the dense batch-1 tile, and other row counts get none (unfused)."""
    import json

    from llmaccel.kernels import gemm_tuning

    dense = GemmConfig(1, 4, 1024, False, 4, 5)
    fused = GemmConfig(1, 8, 2048, False, 8, 4)
    table = {"entries": {
        "16:1:3072:2048": {"backend": "triton", "config": dense.__dict__},
        gemm_tuning.fused_key("norm", 3072, 2048): {"backend": "triton",
                                                    "config": fused.__dict__}}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("LLMACCEL_GEMM_CONFIGS", str(path))
    gemm_tuning.clear_cache()
    try:
        assert gemm_tuning.fused_key("norm", 3072, 2048) == "16norm:1:3072:2048"
        assert gemm_tuning.fused_config("norm", 1, 3072, 2048) == fused
        assert gemm_tuning.fused_config("res", 1, 3072, 2048) == dense
        assert gemm_tuning.fused_config("norm", 4, 3072, 2048) is None
        assert gemm_tuning.fused_config("norm", 1, 2048, 2048) is None
        with pytest.raises(ValueError, match="fused kind"):
            gemm_tuning.fused_key("gelu", 1, 1)
    finally:
        gemm_tuning.clear_cache()


def test_fused_tuner_candidates_fit_in_registers():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tune_fused_decode.py"
    spec = importlib.util.spec_from_file_location("tune_fused_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.role_shapes("llama-3.2-1b") == {"qkv": (3072, 2048), "o": (2048, 2048),
                                               "gate_up": (16384, 2048), "down": (2048, 8192)}
    cands = mod.candidates(2048, 8192)
    assert any(c.block_k == 8192 for c in cands)  # the whole row in one tile is tried
    assert all(c.block_n * c.block_k <= 128 * 32 * c.num_warps for c in cands)
    assert {c.block_k for c in mod.candidates(3072, 2048)} == {1024, 2048}


def test_tuning_scripts_merge_into_the_table(tmp_path):
    """write_table (both tuning scripts' writer) keeps entries a run did not tune."""
    import json

    from llmaccel.kernels import gemm_tuning

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"torch": "old", "entries": {"16:1:8:8": {"a": 1}}}))
    out = gemm_tuning.write_table(str(path), "GPU X", {"16norm:1:8:8": {"b": 2}}, commit="c")
    table = json.loads(out.read_text())
    assert table["entries"] == {"16:1:8:8": {"a": 1}, "16norm:1:8:8": {"b": 2}}
    assert (table["device"], table["torch"], table["commit"]) == ("GPU X", "old", "c")
