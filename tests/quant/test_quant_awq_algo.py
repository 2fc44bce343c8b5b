"""AWQ scale search, clip search and scale folding (llmaccel.quant.awq), on CPU.

The AWQ-format check decodes the packed tensors with `_decode_awq_gemm`, written here from the
layout's definition (shift out nibble i, which holds output feature AWQ_PACK_ORDER[i]), not with
our own unpacker.
"""

from __future__ import annotations

import pytest
import torch

from llmaccel.errors import QuantizationError
from llmaccel.quant.awq import (
    ActivationStats,
    activation_scale_stats,
    apply_clip,
    effective_weight,
    fold_scales_into_linear,
    fold_scales_into_norm,
    output_error,
    quantize_awq,
    quantize_scaled,
    scale_following_weights,
    search_clip,
    search_scales,
)
from llmaccel.quant.formats.awq import AWQ_PACK_ORDER, pack_awq
from llmaccel.quant.rtn import dequantize, quantize_rtn

IN_FEATURES = 256


def _salient_inputs(tokens: int = 256, in_features: int = IN_FEATURES, n_salient: int = 4,
                    seed: int = 0) -> torch.Tensor:
    """Activations where a few channels are ~30x larger than the rest, as in real LLMs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g)
    salient = torch.randperm(in_features, generator=g)[:n_salient]
    x[:, salient] *= 30.0
    return x


def _weights(shapes: list[int], in_features: int = IN_FEATURES,
             seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(out, in_features, generator=g) * 0.02 for out in shapes]


def _rtn_loss(weights: list[torch.Tensor], x: torch.Tensor, group_size: int, sym: bool) -> float:
    """Plain RTN's output error, computed without going through awq's scale code."""
    return sum(output_error(x, w, dequantize(quantize_rtn(w, 4, group_size, sym)))
               for w in weights)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("sym", [False, True])
def test_search_beats_scale1_on_salient_channels(group_size: int, sym: bool) -> None:
    x = _salient_inputs()
    weights = _weights([64, 32, 32])  # q, k, v sharing one input
    scales, info = search_scales(weights, x, bits=4, group_size=group_size, sym=sym, n_grid=10)
    rtn = _rtn_loss(weights, x, group_size, sym)
    assert info.loss_scale1 == pytest.approx(rtn, rel=1e-9)
    assert info.best_alpha > 0
    assert info.ratio < 0.8, f"g{group_size} sym={sym}: AWQ/RTN error ratio {info.ratio:.3f}"
    # The reported loss is what the returned scales really give.
    got = sum(output_error(x, w, effective_weight(quantize_scaled(w, scales, 4, group_size, sym),
                                                  scales)) for w in weights)
    assert got == pytest.approx(info.loss_best, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("group_size", [32, 128])
def test_search_never_worse_than_scale1_on_random_inputs(seed: int, group_size: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(64, 128, generator=g) * torch.rand(128, generator=g)  # mild channel spread
    weights = [torch.randn(16, 128, generator=g)]
    scales, info = search_scales(weights, x, group_size=group_size, n_grid=10)
    assert info.loss_best <= info.loss_scale1
    assert info.loss_scale1 == _rtn_loss(weights, x, group_size, False)  # bit-exact alpha = 0
    got = output_error(x, weights[0],
                       effective_weight(quantize_scaled(weights[0], scales, 4, group_size),
                                        scales))
    assert got <= _rtn_loss(weights, x, group_size, False)


def test_scale1_kept_when_nothing_helps() -> None:
    # Constant activations: every channel looks alike, every alpha gives s = 1.
    x = torch.ones(8, 64)
    w = _weights([8], 64)
    scales, info = search_scales(w, x, group_size=32, n_grid=5)
    assert info.best_alpha == 0.0
    assert torch.equal(scales, torch.ones(64))


def test_activation_stats_stream_equals_one_shot() -> None:
    x = _salient_inputs(tokens=100)
    stats = ActivationStats(IN_FEATURES)
    for chunk in x.split(7):
        stats.update(chunk)
    assert stats.n_tokens == 100
    torch.testing.assert_close(stats.mean_abs(), activation_scale_stats(x))
    torch.testing.assert_close(stats.mean_abs(), x.abs().mean(0))
    with pytest.raises(QuantizationError):
        stats.update(torch.ones(3, 5))
    with pytest.raises(QuantizationError):
        ActivationStats(4).mean_abs()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_folding_preserves_float_function() -> None:
    torch.manual_seed(0)
    d, hidden = 32, 48
    dt = torch.float64
    h = torch.randn(10, d, dtype=dt)
    norm_w = torch.rand(d, dtype=dt) + 0.5
    q, k, v = (torch.randn(n, d, dtype=dt) for n in (32, 16, 32))
    o = torch.randn(d, 32, dtype=dt)
    up, gate = torch.randn(hidden, d, dtype=dt), torch.randn(hidden, d, dtype=dt)
    up_b = torch.randn(hidden, dtype=dt)
    down = torch.randn(d, hidden, dtype=dt)

    def block(norm_w, q, k, v, o, up, up_b, gate, down):  # noqa: ANN001, ANN202
        a = _rms_norm(h, norm_w)
        qs, ks, vs = a @ q.t(), a @ k.t(), a @ v.t()
        att = torch.softmax((qs[:, :16] @ ks.t()) / 4, dim=-1)  # one head, enough here
        y = (att @ vs) @ o.t()
        m = torch.nn.functional.silu(a @ gate.t()) * (a @ up.t() + up_b)
        return y, m @ down.t()

    ref = block(norm_w, q, k, v, o, up, up_b, gate, down)
    s_qkv = torch.rand(d, dtype=dt) * 3 + 0.1
    s_o = torch.rand(32, dtype=dt) * 3 + 0.1
    s_down = torch.rand(hidden, dtype=dt) * 3 + 0.1
    norm_f = fold_scales_into_norm(norm_w, s_qkv)
    q2, k2, v2 = scale_following_weights([q, k, v], s_qkv)
    gate2, up2 = scale_following_weights([gate, up], s_qkv)
    v3, _ = fold_scales_into_linear(v2, s_o)
    (o2,) = scale_following_weights([o], s_o)
    up3, up_b2 = fold_scales_into_linear(up2, s_down, up_b)
    (down2,) = scale_following_weights([down], s_down)
    got = block(norm_f, q2, k2, v3, o2, up3, up_b2, gate2, down2)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    with pytest.raises(QuantizationError):
        fold_scales_into_linear(torch.randn(16, d, dtype=dt), s_o)  # GQA-shaped v_proj


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("sym", [False, True])
def test_clip_never_increases_error(group_size: int, sym: bool) -> None:
    x = _salient_inputs(tokens=128)
    (w,) = _weights([32])
    w.view(-1)[torch.randperm(w.numel(), generator=torch.Generator().manual_seed(3))[:20]] *= 8
    scales, _ = search_scales([w], x, group_size=group_size, sym=sym, n_grid=10)
    ws, xs = w * scales, x / scales
    clip = search_clip(ws, xs, group_size=group_size, sym=sym)
    assert clip.shape == (32, IN_FEATURES // group_size)
    assert (clip > 0.5).all() and (clip <= 1).all()
    no_clip = output_error(x, w, effective_weight(quantize_scaled(w, scales, 4, group_size, sym),
                                                  scales))
    clipped = output_error(x, w, effective_weight(
        quantize_scaled(w, scales, 4, group_size, sym, clip=clip), scales))
    assert clipped <= no_clip * (1 + 1e-6)
    assert (clip < 1).any()  # the outliers make some clipping worthwhile


def test_apply_clip_ratio_one_is_identity() -> None:
    (w,) = _weights([8], 64)
    assert torch.equal(apply_clip(w, torch.ones(8, 2), 32), w)
    half = apply_clip(w, torch.full((8, 2), 0.5), 32)
    limit = w.reshape(8, 2, 32).abs().amax(-1) * 0.5
    assert (half.reshape(8, 2, 32).abs() <= limit.unsqueeze(-1)).all()
    with pytest.raises(QuantizationError):
        apply_clip(w, torch.ones(8, 3), 32)


def _decode_awq_gemm(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """W[o, k] = (code[o, k] - zero[o, k // g]) * scale[k // g, o] from qweight/qzeros/scales,
    one nibble at a time with Python ints; float64."""
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].double()
    in_features, out_features = len(qweight), len(qweight[0]) * 8

    def nibble(words: list[list[int]], row: int, o: int) -> int:
        word = words[row][o // 8] & 0xFFFFFFFF
        return (word >> (4 * AWQ_PACK_ORDER.index(o % 8))) & 0xF

    w = torch.empty(out_features, in_features, dtype=torch.float64)
    for k in range(in_features):
        for o in range(out_features):
            zero = nibble(qzeros, k // group_size, o)
            w[o, k] = (nibble(qweight, k, o) - zero) * scales[k // group_size, o]
    return w


@pytest.mark.parametrize("group_size", [32, 64])
def test_scaled_weight_packs_as_awq(group_size: int) -> None:
    x = _salient_inputs(tokens=64, in_features=128)
    weights = _weights([16, 8], 128)
    result = quantize_awq(weights, x, group_size=group_size, n_grid=8)
    assert result.info.loss_best <= result.info.loss_scale1
    for w, qw in zip(weights, result.quantized):
        packed = pack_awq(qw.codes, qw.scales, qw.zeros, group_size)
        decoded = _decode_awq_gemm(packed, group_size)
        torch.testing.assert_close(decoded.float(), dequantize(qw), rtol=0, atol=0)
        w_hat = effective_weight(qw, result.scales)
        torch.testing.assert_close(decoded.float() / result.scales, w_hat, rtol=0, atol=0)
        # Clip on top of the scales does not lose what the scale search gained.
        assert output_error(x, w, w_hat) <= output_error(
            x, w, effective_weight(quantize_scaled(w, result.scales, 4, group_size),
                                   result.scales)) * (1 + 1e-6)


def test_bad_arguments() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(QuantizationError):
        search_scales([], x)
    with pytest.raises(QuantizationError):
        search_scales([torch.randn(8, 32)], x, group_size=32)
    with pytest.raises(QuantizationError):
        search_scales([torch.randn(8, 64)], x, group_size=48)
    with pytest.raises(QuantizationError):
        quantize_scaled(torch.randn(8, 64), -torch.ones(64), group_size=32)


def test_clip_search_chunks_rows_and_samples_tokens(monkeypatch) -> None:
    """Output rows in chunks give the same clips as one einsum; past `max_tokens` rows of x the
    search scores evenly spaced rows, exactly as if given only those."""
    import llmaccel.quant.awq as awq

    x = _salient_inputs(tokens=96)
    (w,) = _weights([32])
    w.view(-1)[torch.randperm(w.numel(), generator=torch.Generator().manual_seed(3))[:20]] *= 8
    whole = search_clip(w, x, group_size=32)
    monkeypatch.setattr(awq, "CLIP_CHUNK_ELEMENTS", 96 * 4 * 5)  # chunks of 5 output rows
    assert torch.equal(search_clip(w, x, group_size=32), whole)
    rows = torch.linspace(0, 95, 40).round().long()
    assert torch.equal(search_clip(w, x, group_size=32, max_tokens=40),
                       search_clip(w, x.reshape(-1, x.shape[-1])[rows], group_size=32))
