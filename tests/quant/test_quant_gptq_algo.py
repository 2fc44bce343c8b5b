"""The GPTQ algorithm (`llmaccel.quant.gptq`): layer output error below RTN's on correlated
inputs, identical to RTN when there is nothing to exploit, packs as a GPTQ checkpoint, and
the act-order group map. Packed tensors are decoded by `decode_gptq` (gptq_decoder.py),
written from the format's definition, not by our unpacker."""

from __future__ import annotations

import pytest
import torch
from gptq_decoder import decode_gptq

from llmaccel.errors import QuantizationError
from llmaccel.quant.gptq import (
    HessianAccumulator,
    dequantize_with_g_idx,
    gptq_quantize,
    sink_weight,
)
from llmaccel.quant.rtn import dequantize, quantize_rtn

CASES = [(4, g, sym) for g in (32, 64, -1) for sym in (True, False)]  # (bits, group, sym)


def _calibration(tokens: int = 2048, features: int = 128, seed: int = 0) -> torch.Tensor:
    """X = Z @ A: independent latents mixed by a random matrix, plus channels of unequal scale,
    so input channels are correlated as in real activations."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, features, generator=g)
    a = torch.randn(features, features, generator=g) / features**0.5
    scale = torch.rand(features, generator=g) * 2 + 0.1
    return (z @ a) * scale


def _weight(out_features: int = 64, in_features: int = 128, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w *= torch.rand(out_features, 1, generator=g) + 0.5
    return w


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return 2.0 / x.shape[0] * x.t() @ x


def _out_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return (x @ w.t() - x @ w_hat.t()).norm().item()


@pytest.fixture(scope="module")
def calib() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _calibration()
    return x, _weight(), _hessian(x)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits,group_size,sym", CASES)
def test_gptq_output_error_below_rtn(calib, bits, group_size, sym, act_order):
    x, w, h = calib
    res = gptq_quantize(w, h, bits=bits, group_size=group_size, sym=sym, act_order=act_order)
    rtn = quantize_rtn(w, bits=bits, group_size=group_size, sym=sym)
    ratio = _out_err(x, w, res.dequantize()) / _out_err(x, w, dequantize(rtn))
    assert ratio < 0.8, f"GPTQ/RTN output error ratio {ratio:.3f}"


@pytest.mark.parametrize("bits,group_size,sym", CASES + [(8, -1, True), (4, 128, False)])
def test_identity_hessian_equals_rtn(bits, group_size, sym):
    # H = c * I: no correlation, so every error-feedback term is 0 and GPTQ must round exactly
    # as RTN does (same grids from the untouched weights, same rounding).
    w = _weight()
    rtn = quantize_rtn(w, bits=bits, group_size=group_size, sym=sym)
    for act_order in (False, True):
        res = gptq_quantize(w, torch.eye(128) * 3.0, bits=bits, group_size=group_size, sym=sym,
                            act_order=act_order)
        assert torch.equal(res.qweight.codes, rtn.codes)
        assert torch.equal(res.qweight.scales, rtn.scales)
        assert torch.equal(res.qweight.zeros, rtn.zeros)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size,sym,fmt,offset",
                         [(32, True, "gptq", 1), (64, False, "gptq_v2", 0)])
def test_packs_and_decodes(calib, group_size, sym, fmt, offset, act_order):
    _, w, h = calib
    w, h = w[:16, :64].contiguous(), h[:64, :64].contiguous()  # small: the decoder is per element
    res = gptq_quantize(w, h, bits=4, group_size=group_size, sym=sym, act_order=act_order)
    packed = res.pack(fmt)
    decoded = decode_gptq(packed, 4, zero_offset=offset)
    assert torch.equal(decoded.to(torch.float32), res.dequantize())
    assert torch.equal(packed["g_idx"], res.g_idx)
    if not act_order:  # contiguous groups: rtn.dequantize reads the same weights
        assert torch.equal(dequantize(res.qweight), res.dequantize())


@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_act_order_g_idx(calib, group_size):
    _, w, h = calib
    res = gptq_quantize(w, h, bits=4, group_size=group_size, act_order=True)
    glen = 128 if group_size == -1 else group_size
    perm = res.perm
    assert perm is not None and sorted(perm.tolist()) == list(range(128))
    d = torch.diagonal(h)[perm]
    assert bool((d[:-1] >= d[1:]).all())  # decreasing diag(H)
    assert res.g_idx.dtype == torch.int32
    counts = torch.bincount(res.g_idx.long(), minlength=128 // glen)
    assert counts.tolist() == [glen] * (128 // glen)  # every group full, none out of range
    # the j-th processed column is in group j // group_len
    assert torch.equal(res.g_idx[perm].long(), torch.arange(128) // glen)
    assert torch.equal(dequantize_with_g_idx(res.qweight, res.g_idx), res.dequantize())


@pytest.mark.parametrize("sym", [True, False])
def test_dead_channels_and_damping(calib, sym):
    x, w, _ = calib
    x = x.clone()
    dead = torch.tensor([0, 5, 33, 127])
    x[:, dead] = 0
    h = _hessian(x)
    for damp, act_order in ((0.01, False), (0.1, True), (0.0, False)):
        res = gptq_quantize(w, h, bits=4, group_size=32, sym=sym, damp_percent=damp,
                            act_order=act_order)
        w_hat = res.dequantize()
        assert torch.isfinite(w_hat).all()
        assert bool((w_hat[:, dead] == 0).all())  # inputs never seen: weight zeroed, exactly
        rtn = quantize_rtn(w, bits=4, group_size=32, sym=sym)
        assert _out_err(x, w, w_hat) < _out_err(x, w, dequantize(rtn))
    # rank-deficient Hessian (fewer tokens than features) is fixed by damping
    few = x[:16]
    res = gptq_quantize(w, _hessian(few), bits=4, group_size=32, sym=sym)
    assert torch.isfinite(res.dequantize()).all()
    # a Hessian that is not positive definite even after damping is a clear error
    with pytest.raises(QuantizationError, match="damp_percent"):
        gptq_quantize(w, -torch.eye(128), bits=4, group_size=32, damp_percent=0.01)


def test_hessian_accumulator_streaming(calib):
    x = calib[0]
    acc = HessianAccumulator(128)
    # uneven batches, one of them 3-D [batch, seq, features] as a model's hidden states are
    for chunk in (x[:1], x[1:300], x[300:301], x[301:1000], x[1000:].reshape(8, 131, 128)):
        acc.add(chunk)
    acc.add(x[:0])  # empty batch: no-op
    assert acc.n_tokens == 2048
    torch.testing.assert_close(acc.hessian, _hessian(x), rtol=1e-5, atol=1e-5)
    three_d = HessianAccumulator(128)
    three_d.add(x.reshape(16, 128, 128).to(torch.bfloat16).to(torch.float32))
    torch.testing.assert_close(three_d.hessian, _hessian(x.to(torch.bfloat16).float()))
    with pytest.raises(QuantizationError):
        HessianAccumulator(128).hessian
    with pytest.raises(QuantizationError):
        acc.add(torch.zeros(4, 64))


def test_first_row_weight_counts_the_row_that_many_times(calib):
    """A sequence's first row weighted w equals that row repeated w times (an integer w), and
    the token count grows by w - 1; the weight applies to each call's first row only."""
    x = calib[0]
    seqs = x[:1024].reshape(8, 128, 128)
    weighted = HessianAccumulator(128)
    repeated = HessianAccumulator(128)
    for seq in seqs:
        weighted.add(seq, first_row_weight=4)
        repeated.add(torch.cat([seq[:1]] * 4 + [seq[1:]]))
    assert weighted.n_tokens == repeated.n_tokens == 8 * (128 + 3)
    torch.testing.assert_close(weighted.hessian, repeated.hessian, rtol=1e-5, atol=1e-6)
    with pytest.raises(QuantizationError, match="first_row_weight"):
        weighted.add(seqs[0], first_row_weight=0.5)


def test_sink_weight_default_scales_with_the_sequence():
    assert sink_weight(512) == 8 and sink_weight(2048) == 32 and sink_weight(16) == 1
    assert sink_weight(2048, 1) == 1 and sink_weight(2048, 5.5) == 5.5
    with pytest.raises(QuantizationError, match="sink weight"):
        sink_weight(512, 0.5)


def test_bad_arguments(calib):
    _, w, h = calib
    with pytest.raises(QuantizationError):
        gptq_quantize(w, h[:64, :64])
    with pytest.raises(QuantizationError):
        gptq_quantize(w, h, group_size=48)
    with pytest.raises(QuantizationError):
        gptq_quantize(w, h, bits=3)
    with pytest.raises(QuantizationError):
        gptq_quantize(w, h, block_size=0)


@pytest.mark.parametrize("block_size", [1, 16, 48, 128, 256])
def test_block_size_does_not_change_result(calib, block_size):
    # Lazy batch updates are an exact reordering of the same arithmetic up to fp32 rounding;
    # results should match the one-block run on (almost) every code.
    _, w, h = calib
    ref = gptq_quantize(w, h, bits=4, group_size=32, block_size=128)
    res = gptq_quantize(w, h, bits=4, group_size=32, block_size=block_size)
    same = (res.qweight.codes == ref.qweight.codes).float().mean().item()
    assert same > 0.99
