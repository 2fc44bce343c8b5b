"""L2 prefetch of the next GEMV's weights (kernels/l2_prefetch.py, models/l2_prefetch.py,
csrc/common.cuh `l2_prefetch_share`).

CPU: the ranges (cap, order, alignment, the kernels' argument contract), the decode order and
the links a model gets (each layer the next one's scales and codes; the head the first qkv),
and that every CUDA C GEMV source still compiles with the prefetch for sm_80 and sm_90.
GPU: outputs are bit for bit those without prefetch (int4 and FP8, in a PDL graph chain), and
an engine on a dummy GPTQ model links every layer and decodes the same greedy tokens with
prefetch off."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch
from nvrtc_helpers import use_nvrtc
from tiny_models import make_tiny_model, tiny_configs

from llmaccel.kernels import cuda_rtc, l2_prefetch
from llmaccel.kernels.l2_prefetch import MAX_RANGES, kernel_args, ranges_of
from llmaccel.models.config import make_model_config
from llmaccel.models.l2_prefetch import decode_order, link_l2_prefetch, streamed_weights
from llmaccel.models.loader import get_model


def test_ranges_cut_at_the_cap_in_order():
    a = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
    b = torch.zeros(64, dtype=torch.uint8)
    assert ranges_of([a, b], 10_000, cuda_only=False) == ((a.data_ptr(), 4000),
                                                          (b.data_ptr(), 64))
    # the cap cuts the tensor it reaches, rounded down to 16 bytes, and the rest get nothing
    assert ranges_of([b, a], 1000, cuda_only=False) == ((b.data_ptr(), 64),
                                                        (a.data_ptr(), 928))
    assert ranges_of([a, b], 8, cuda_only=False) == ()
    assert ranges_of([a, b, a], 10**6, cuda_only=False)[MAX_RANGES:] == ()


def test_ranges_skip_what_the_instruction_cannot_take():
    t = torch.zeros(256, dtype=torch.uint8)
    assert ranges_of([t[1:]], 4096, cuda_only=False) == ()  # not 16-byte aligned
    assert ranges_of([torch.zeros(16, 16)[:, 0]], 4096, cuda_only=False) == ()  # strided
    assert ranges_of([t], 4096) == ()  # the kernels read device memory only
    assert ranges_of([t[16:]], 4096, cuda_only=False) == ((t[16:].data_ptr(), 240),)


def test_kernel_args_pad_and_check():
    args = kernel_args(((4096, 512),), tail=7)
    assert len(args) == 2 * MAX_RANGES + 1
    assert [a.value for a in args] == [4096, 512, None, 0, 7]
    assert isinstance(args[1], ctypes.c_longlong) and isinstance(args[-1], ctypes.c_int)
    assert [a.value for a in kernel_args(None, 0)] == [None, 0, None, 0, 0]
    with pytest.raises(ValueError, match="16-byte aligned"):
        kernel_args(((4100, 512),))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel_args(((4096, 500),))
    with pytest.raises(ValueError, match="at most"):
        kernel_args(((16, 16),) * (MAX_RANGES + 1))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"l2-{request.param}")
    make_tiny_model(tiny_configs()[request.param], d, seed=4)
    return get_model(make_model_config(str(d), dtype="float32"), "cpu",
                     attention_backend="torch")


def test_decode_order_and_links(tiny):
    order = decode_order(tiny)
    layers = tiny.model.layers
    assert len(order) == 4 * len(layers) + 1
    first = layers[0]
    assert [m for m, _ in order[:4]] == [first.self_attn.qkv_proj, first.self_attn.o_proj,
                                         first.mlp.gate_up_proj, first.mlp.down_proj]
    head = order[-1][0]
    assert head is (tiny.lm_head if not tiny.tie_word_embeddings
                    else tiny.model.embed_tokens)
    # a CPU model is left unlinked (the kernels read device memory) ...
    assert link_l2_prefetch(tiny, 2**30) == 0
    assert all(m.l2_prefetch == () for m, _ in order)
    # ... and with the device check off, each layer gets the next one's weights, the head the
    # first qkv's (the next step's first GEMV)
    assert link_l2_prefetch(tiny, 2**30, cuda_only=False) == len(order)
    for i, (m, _) in enumerate(order):
        nxt = order[(i + 1) % len(order)][1]
        assert m.l2_prefetch == tuple((t.data_ptr(), t.numel() * t.element_size())
                                      for t in nxt)
    assert link_l2_prefetch(tiny, 0, cuda_only=False) == 0
    assert all(m.l2_prefetch == () for m, _ in order)


def test_streamed_weights_put_scales_first():
    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.kernel_weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.int32),
                                                    requires_grad=False)
            self.kernel_scales = torch.nn.Parameter(torch.zeros(8, 1), requires_grad=False)

    p = Packed()
    assert [t is x for t, x in zip(streamed_weights(p), (p.kernel_scales, p.kernel_weight))] \
        == [True, True]
    plain = torch.nn.Linear(4, 4, bias=False)
    assert streamed_weights(plain) == [plain.weight]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,defines", [
    ("gemv_w4.cu", {"ROWS": 4, "CHUNKS": 1, "THREADS": 96, "X_BF16": 1, "SCALE_KIND": 0,
                    "HAS_ZEROS": 0, "HAS_BIAS": 0, "MATH": 1, "PROLOGUE": 0, "RESIDUAL": 0,
                    "SILU_OUT": 0, "ROPE": 0, "HEAD_DIM": 0}),
    ("gemv_fp8_cc.cu", {"THREADS": 192, "ROWS": 2, "X_BF16": 1, "HAS_BIAS": 0,
                        "SILU_OUT": 0})])
def test_sources_compile_with_the_prefetch(arch, name, defines, monkeypatch):
    """The bulk prefetch is sm_90 PTX: the guard keeps sm_80 builds compiling, and sm_90 has
    the instruction (in the PTX, as UBLKPF after ptxas)."""
    use_nvrtc(monkeypatch)
    kernel = name.removesuffix(".cu")
    src, headers = cuda_rtc.source_files(name, "common.cuh")
    if name == "gemv_fp8_cc.cu" and arch == "sm_80":
        pytest.skip("the e4m3 conversion needs sm_89")
    ptx = cuda_rtc.compile_ptx(src, kernel, arch, defines, headers)
    assert ("cp.async.bulk.prefetch.L2.global" in ptx) == (arch == "sm_90")


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_prefetch_changes_no_bits_in_a_pdl_graph(fp8):
    from llmaccel.kernels import pdl

    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    from llmaccel.kernels.gemv_fp8 import quantize_row_fp8
    from llmaccel.kernels.gemv_fp8_cuda import fp8_gemv_cuda, supports
    from llmaccel.kernels.gemv_w4_cuda import w4a16_gemv_cuda

    used = pdl.configure(torch.device("cuda"), True)
    try:
        k, group = 2048, 128
        gen = torch.Generator(device="cuda").manual_seed(5)
        if fp8:
            layers = [((torch.rand(k, 1, device="cuda", generator=gen) * 0.01),
                       (torch.randn(k, k, device="cuda", generator=gen) * 0.5)
                       .to(torch.float8_e4m3fn)) for _ in range(5)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            if not supports(x, layers[0][1], layers[0][0]):
                pytest.skip("no CUDA C FP8 GEMV on this GPU")

            def gemv(h, ts, pf):
                q, s = quantize_row_fp8(h)
                return fp8_gemv_cuda(q, s, ts[1], ts[0], prefetch=pf)
        else:
            layers = [((torch.rand(k, k // group, device="cuda", generator=gen) * 0.01)
                       .to(torch.bfloat16),
                       torch.randint(-2**31, 2**31 - 1, (k, k // 8), device="cuda",
                                     dtype=torch.int32, generator=gen)) for _ in range(5)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

            def gemv(h, ts, pf):
                return w4a16_gemv_cuda(h, ts[1], ts[0], None, group, prefetch=pf)

        def chain(cap):
            pfs = [ranges_of(list(layers[(i + 1) % len(layers)]), cap) for i in
                   range(len(layers))]
            h = x
            for i, ts in enumerate(layers):
                h = gemv(h, ts, pfs[i])
                h = h / h.float().norm().clamp_min(1e-6).to(h.dtype) * 40
            return h

        outs = {}
        for cap in (0, 2**30, 3000):  # none, all of it, a cut range
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                chain(cap)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(cap)
            graph.replay()
            torch.cuda.synchronize()
            outs[cap] = out.clone()
        assert torch.isfinite(outs[0].float()).all()
        assert torch.equal(outs[0], outs[2**30]) and torch.equal(outs[0], outs[3000])
    finally:
        pdl.configure(torch.device("cuda"), used)


@gpu
def test_gpu_engine_links_every_layer_and_tokens_match_without(monkeypatch):
    from llmaccel import LLM, SamplingParams
    from llmaccel.quant.presets import preset_config

    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    tokens = {}
    for mib in ("24", "0"):
        monkeypatch.setattr(l2_prefetch, "CAP_BYTES", int(mib) << 20)
        llm = LLM("llama-3.2-1b", load_format="dummy", dtype="bfloat16", max_model_len=512,
                  hf_overrides={"quantization_config": preset_config("gptq-int4-g128")},
                  skip_tokenizer_init=True, enable_prefix_caching=False,
                  gpu_memory_utilization=0.3,
                  cudagraph_capture_sizes=[1])
        model = llm.engine.model
        linked = [m.l2_prefetch != () for m, _ in decode_order(model)]
        assert all(linked[:-1]) if mib != "0" else not any(linked)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        tokens[mib] = [list(llm.generate({"prompt_token_ids": [(13 * i + 7 * j) % 900 + 10
                                                               for j in range(40)]},
                                         params)[0].outputs[0].token_ids) for i in range(3)]
        del llm, model
        gc.collect()  # engines of later tests size their KV cache from free memory
        torch.cuda.empty_cache()
    assert tokens["24"] == tokens["0"]
