"""The CUDA C batch-1 FP8 GEMVs (`kernels/gemv_fp8_cuda.py`): CUDA cores (`csrc/gemv_fp8_cc.cu`,
the default) and tensor cores (`csrc/gemv_fp8.cu`).

CPU (CI): its tile choice, when the engine takes it (never off CUDA), and that its source
compiles with NVRTC for sm_89 and sm_90 where an NVRTC library is installed. GPU (`pytest -m
gpu`, on the device): against `gemv_fp8.fp8_gemv_ref` on awkward shapes, with bias and the
SiLU epilogue, and inside a CUDA graph with PDL.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cuda_graph_helpers import pdl_on, replay_in_graph
from nvrtc_helpers import use_nvrtc

from llmaccel.kernels import cuda_rtc
from llmaccel.kernels.gemv_fp8_cuda import (CudaGemvFp8Config, _source, _source_cc,
                                            chosen_config, default_cc_config, default_config,
                                            fp8_gemv_cuda, supports)
from llmaccel.models.layers import fp8_linear


def test_tiles():
    assert default_config(5120, 3072) == CudaGemvFp8Config(8, 1)
    assert default_config(5120, 3072).warps(3072) == 6
    assert default_config(3072, 8192).warps(8192) == 16
    assert default_config(1536, 8960).fits(8960)  # qwen2.5-1.5b's down projection
    assert default_config(64, 96) is None  # K not a multiple of 64
    assert not CudaGemvFp8Config(16, 2).fits(2048)  # too many registers
    # the CUDA-core kernel: K/16 threads, 2 rows a block
    assert default_cc_config(3072, 3072) == CudaGemvFp8Config(cc_rows=2)
    assert default_cc_config(16384, 3072).warps(3072) == 6
    assert default_cc_config(3072, 8192).warps(8192) == 16
    assert default_cc_config(64, 20000) is None  # over 1024 threads
    # untuned calls take the CUDA-core kernel where it fits, else the tensor-core one
    assert chosen_config(5120, 3072) == CudaGemvFp8Config(cc_rows=2)
    assert chosen_config(64, 20480) == default_config(64, 20480)


def test_not_taken_off_cuda():
    w = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    s = torch.ones(64, 1)
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    assert not supports(x, w, s)
    layer = SimpleNamespace(weight=w, weight_scale=s, input_size=128)
    assert not fp8_linear._cuda_gemv(layer, x)
    assert not fp8_linear._cuda_gemv_possible(layer)


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_source_compiles_with_nvrtc(arch, monkeypatch):
    use_nvrtc(monkeypatch)
    for defines in ({"WARPS": 6, "LOADS": 8, "RG": 1, "X_BF16": 1, "HAS_BIAS": 0,
                     "SILU_OUT": 0},
                    {"WARPS": 3, "LOADS": 4, "RG": 2, "X_BF16": 0, "HAS_BIAS": 1,
                     "SILU_OUT": 1}):
        source, headers = _source()
        assert cuda_rtc.compile_cubin(source, "gemv_fp8", arch, defines, headers)[:4] == b"\x7fELF"
    for defines in ({"THREADS": 192, "ROWS": 4, "X_BF16": 1, "HAS_BIAS": 0, "SILU_OUT": 0},
                    {"THREADS": 512, "ROWS": 2, "X_BF16": 0, "HAS_BIAS": 1, "SILU_OUT": 1}):
        source, headers = _source_cc()
        assert cuda_rtc.compile_cubin(source, "gemv_fp8_cc", arch, defines,
                                      headers)[:4] == b"\x7fELF"


gpu = pytest.mark.gpu


def _case(n, k, dtype, seed):
    from llmaccel.quant.fp8 import FP8_DTYPE

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 40).clamp(-448, 448).to(FP8_DTYPE)
    ws = torch.rand(n, 1, device="cuda", generator=g) * 1e-3 + 1e-4
    x = (torch.randn(1, k, device="cuda", generator=g) * 3).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g).to(dtype)
    return w, ws, x, bias


@gpu
@pytest.mark.parametrize("n,k", [(5120, 3072), (37, 1536), (3072, 8192), (1000, 8960),
                                 (8, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rg", [1, 2, "cc2", "cc4", "cc3"])
def test_gpu_matches_reference(n, k, dtype, rg):
    from llmaccel.kernels.gemv_fp8 import fp8_gemv_ref, quantize_row_fp8

    if not (cuda_rtc.available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("no FP8 CUDA C kernels here")
    w, ws, x, bias = _case(n, k, dtype, n + k)
    cfg = default_config(n, k)
    if isinstance(rg, str):  # the CUDA-core kernel with this many rows per block
        cfg = CudaGemvFp8Config(cc_rows=int(rg[2:]))
    elif CudaGemvFp8Config(cfg.loads, rg).fits(k):
        cfg = CudaGemvFp8Config(cfg.loads, rg)
    x_q, x_scale = quantize_row_fp8(x)
    for b in (None, bias):
        want = fp8_gemv_ref(x, w, ws, b).float()
        got = fp8_gemv_cuda(x_q, x_scale, w, ws, b, cfg)
        assert got.shape == want.shape and got.dtype == dtype
        assert (got.float() - want).norm() / want.norm() < 5e-3
    if n % 2 == 0 and cfg.cc_rows % 2 == 0:
        want = fp8_gemv_ref(x, w, ws, bias, silu_out=True).float()
        got = fp8_gemv_cuda(x_q, x_scale, w, ws, bias, cfg, silu_out=True).float()
        assert got.shape == (1, n // 2)
        assert (got - want).norm() / want.norm() < 1e-2


@gpu
def test_gpu_pdl_chain_in_a_graph():
    from llmaccel.kernels.gemv_fp8 import fp8_gemv_ref, quantize_row_fp8

    if not (cuda_rtc.available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("no FP8 CUDA C kernels here")
    with pdl_on():
        k = 2048
        layers = [_case(k, k, torch.bfloat16, i)[:2] for i in range(5)]
        x0 = _case(k, k, torch.bfloat16, 9)[2]

        def chain(step):
            h = x0
            for w, ws in layers:
                h = step(h, w, ws)
            return h

        ref = chain(lambda h, w, ws: fp8_gemv_ref(h, w, ws))

        def ours(h, w, ws):
            q, s = quantize_row_fp8(h)
            return fp8_gemv_cuda(q, s, w, ws)

        out = replay_in_graph(lambda: chain(ours))
        assert (out.float() - ref.float()).norm() / ref.float().norm() < 3e-2
