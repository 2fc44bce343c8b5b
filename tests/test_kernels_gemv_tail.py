"""The row-norm tail of the batch-1 GEMVs (kernels/gemv_common.py): the last program to finish
an int4 or FP8 GEMV with a residual epilogue writes the next RMSNorm of the updated residual
row (and, for an FP8 consumer, that row quantized), equal to the separate kernels
(`fused_add_rms_norm_ref`, `quantize_fp8_per_token`); the counter is left at zero, so the same
counter serves the next launch. Interpreted on CPU (CI); on a GPU with `pytest -m gpu` too."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from llmaccel.kernels.gemm import pack_int4_rows
from llmaccel.kernels.gemv_common import RowNormTail
from llmaccel.kernels.gemv_fp8 import GemvFp8Config, fp8_gemv, fp8_gemv_ref, quantize_row_fp8
from llmaccel.kernels.gemv_w4 import GemvW4Config, w4a16_gemv
from llmaccel.kernels.rmsnorm import rms_norm, rms_norm_ref
from llmaccel.quant.fp8 import quantize_fp8_per_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tail(n: int, dtype: torch.dtype, quant: bool, seed: int) -> RowNormTail:
    w = (torch.rand(n, generator=_gen(seed)) + 0.5).to(dtype).to(DEVICE)
    return RowNormTail(w, 1e-5, torch.zeros(1, dtype=torch.int32, device=DEVICE),
                       torch.empty(n, dtype=dtype, device=DEVICE),
                       torch.empty(1, dtype=torch.float32, device=DEVICE) if quant else None)


def _ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for the odd element one rounding step off: the tail sums the squares in
    another order than the separate kernel, so rstd can differ in its last bit."""
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}.get(want.dtype, 2e-6)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=0)
    assert (got == want).float().mean().item() >= 0.95


def _check_tail(tail: RowNormTail, residual: torch.Tensor, quant: bool) -> None:
    """The tail's output equals the separate kernels' RMSNorm (and row quantization) of the
    residual row the GEMV left (the interpreter truncates its bf16 roundings, the same way in
    both), and the PyTorch references up to that; the counter is back at zero."""
    want = rms_norm(residual, tail.weight, tail.eps)
    ref = rms_norm_ref(residual.cpu(), tail.weight.cpu(), tail.eps)
    torch.testing.assert_close(want.cpu().float(), ref.float(), atol=0.02, rtol=0.02)
    got = tail.out.reshape(want.shape)
    if quant:
        want_q, want_scale = quantize_row_fp8(want)
        torch.testing.assert_close(tail.scale, want_scale, rtol=2 ** -7, atol=0)
        # e4m3 codes: one step of the 3-bit mantissa at most, where rstd's last bit differs
        torch.testing.assert_close(got.float(), want_q.float(), rtol=2 ** -3, atol=2 ** -9)
        assert (got == want_q).float().mean().item() >= 0.95
        ref_q, _ = quantize_fp8_per_token(want.cpu())
        assert torch.equal(want_q.cpu().float(), ref_q.float())
    else:
        _ulp_close(got, want)
    assert int(tail.counter.item()) == 0


# int4: (n, k, group, config, the tail's widest one-load row); n not a multiple of the tile
# (rows past the end), several programs, and rows wider than the one-load row (in chunks)
W4_CASES = [(40, 128, 64, GemvW4Config(8, 64, 1, 2, 2), 8192),
            (72, 256, 128, GemvW4Config(16, 128, 2, 3, 2), 8192),
            (72, 256, 128, GemvW4Config(16, 128, 2, 3, 2), 32),
            (2100, 64, 32, GemvW4Config(512, 32, 4, 2, 2), 1024)]


@pytest.mark.parametrize("n,k,group,cfg,row_max", W4_CASES)
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_gemv_norm_tail(n, k, group, cfg, row_max, quant, dtype, monkeypatch):
    from llmaccel.kernels import gemv_common

    monkeypatch.setattr(gemv_common, "TAIL_ROW_MAX", row_max)
    g = _gen(n + k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).to(dtype)
    x = torch.randn(1, k, generator=g).to(dtype)
    res0 = torch.randn(1, n, generator=g).to(dtype)
    args = [t.to(DEVICE) for t in (x, pack_int4_rows(codes), scales)]
    plain = w4a16_gemv(*args, None, group, None, cfg, residual=res0.clone().to(DEVICE))
    tail = _tail(n, dtype, quant, seed=n)
    for _ in range(2):  # the counter must be reusable
        res = res0.clone().to(DEVICE)
        out = w4a16_gemv(*args, None, group, None, cfg, residual=res, norm_tail=tail)
        assert out is res and torch.equal(res, plain)  # the epilogue itself is unchanged
        _check_tail(tail, res, quant)


@pytest.mark.parametrize("n,k,cfg", [(40, 64, GemvFp8Config(8, 32, 1, 2)),
                                     (72, 192, GemvFp8Config(16, 64, 2, 3, prequant=True))])
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemv_norm_tail(n, k, cfg, quant, dtype):
    g = _gen(n * k)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(E4M3)
    s = torch.rand(n, 1, generator=g) * 0.01 + 1e-3
    x = torch.randn(1, k, generator=g).to(dtype)
    res0 = torch.randn(1, n, generator=g).to(dtype)
    tail = _tail(n, dtype, quant, seed=k)
    for _ in range(2):
        res = res0.clone().to(DEVICE)
        fp8_gemv(*[t.to(DEVICE) for t in (x, w, s)], None, cfg, residual=res, norm_tail=tail)
        want = fp8_gemv_ref(x, w, s, residual=res0.clone())
        tol = (3e-2 if dtype == torch.bfloat16 else 1e-5) * want.float().abs().max().item()
        torch.testing.assert_close(res.float().cpu(), want.float(), atol=tol, rtol=0)
        _check_tail(tail, res, quant)


def test_norm_tail_arguments_are_checked():
    n, k = 16, 64
    w = torch.zeros(n, k).to(E4M3).to(DEVICE)
    s = torch.ones(n, 1, device=DEVICE)
    x = torch.zeros(1, k, device=DEVICE)
    tail = _tail(n, torch.float32, False, seed=0)
    with pytest.raises(ValueError, match="needs residual"):
        fp8_gemv(x, w, s, norm_tail=tail)
    bad = RowNormTail(tail.weight[:8], 1e-5, tail.counter, tail.out)
    with pytest.raises(ValueError, match="weight"):
        fp8_gemv(x, w, s, residual=torch.zeros(1, n, device=DEVICE), norm_tail=bad)
    with pytest.raises(ValueError, match="counter"):
        fp8_gemv(x, w, s, residual=torch.zeros(1, n, device=DEVICE),
                 norm_tail=RowNormTail(tail.weight, 1e-5, tail.out, tail.out))
