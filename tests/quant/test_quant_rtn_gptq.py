"""RTN quantization and the GPTQ checkpoint layout.

The GPTQ checks decode our packed tensors with `decode_gptq` (gptq_decoder.py), written from
the format's definition (Python ints and shifts, one element at a time), never with our own
unpacker.
"""

from __future__ import annotations

import json

import pytest
import torch
from gptq_decoder import decode_gptq

from llmaccel.errors import CorruptCheckpointError
from llmaccel.quant.formats.gptq import (
    gptq_quantization_config,
    pack_gptq,
    unpack_gptq,
)
from llmaccel.quant.rtn import QuantizedWeight, dequantize, quantize_rtn

RTN_CASES = [  # (bits, group_size, sym)
    (8, -1, True), (8, -1, False), (8, 128, True),
    (4, 32, True), (4, 64, True), (4, 128, True), (4, -1, True),
    (4, 32, False), (4, 64, False), (4, 128, False), (4, -1, False),
]


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows of different magnitudes plus a few outliers, like real Linear weights."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    w *= torch.rand(out_features, 1, generator=g) * 0.1 + 0.01
    w.view(-1)[torch.randint(0, w.numel(), (8,), generator=g)] *= 12
    return w


def _i32(word: int) -> int:
    """A 32-bit pattern written in hex, as the signed int32 a checkpoint stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


# ---------------------------------------------------------------- RTN


@pytest.mark.parametrize("bits,group_size,sym", RTN_CASES)
def test_rtn_error_within_half_step(bits: int, group_size: int, sym: bool) -> None:
    w = _weight(72, 256)
    qw = quantize_rtn(w, bits=bits, group_size=group_size, sym=sym)
    n_groups = 1 if group_size == -1 else 256 // group_size
    assert qw.codes.shape == (72, 256) and qw.codes.dtype == torch.uint8
    assert qw.scales.shape == qw.zeros.shape == (72, n_groups)
    assert qw.scales.dtype == torch.float16 and qw.zeros.dtype == torch.int32
    assert int(qw.codes.max()) <= 2**bits - 1
    if sym:
        assert bool((qw.zeros == 2 ** (bits - 1)).all())
    else:
        assert 0 <= int(qw.zeros.min()) and int(qw.zeros.max()) <= 2**bits - 1
    err = (w.double() - dequantize(qw).double()).abs().reshape(72, n_groups, -1)
    half_step = qw.scales.double().unsqueeze(-1) / 2
    assert bool((err <= half_step * (1 + 1e-6)).all())


def test_int8_per_channel_uses_restricted_symmetric_range() -> None:
    w = _weight(16, 64)
    qw = quantize_rtn(w, bits=8, group_size=-1, sym=True)
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = qw.scales.float()
    assert bool((scale >= absmax / 127).all())  # rounded up to fp16 ...
    assert bool((scale <= absmax / 127 * (1 + 2**-10)).all())  # ... by at most one ulp
    signed = qw.codes.int() - 128
    assert int(signed.min()) >= -127 and int(signed.max()) <= 127  # code 0 (-128) unused
    assert torch.equal(quantize_rtn(-w, bits=8, group_size=-1).codes.int() - 128, -signed)


def test_int4_sym_uses_gptq_full_range() -> None:
    w = _weight(32, 128)
    qw = quantize_rtn(w, bits=4, group_size=128, sym=True)
    absmax = w.abs().amax(dim=1, keepdim=True)
    assert torch.allclose(qw.scales.float(), 2 * absmax / 15, rtol=2**-10)
    # The extremes sit at +-7.5 steps: +absmax rounds to code 15 (error scale / 2), and the
    # fp16 scale, rounded up, keeps -absmax just inside -7.5, so it lands on code 1 or 0.
    assert int(qw.codes.max()) == 15 and int(qw.codes.min()) <= 1
    extreme = (w.abs() == absmax)
    err = (w - dequantize(qw)).abs()
    assert bool((err[extreme] <= qw.scales.float().expand_as(w)[extreme] / 2 + 1e-7).all())


def test_rtn_smaller_groups_give_smaller_error() -> None:
    w = _weight(64, 512)
    errs = [(w - dequantize(quantize_rtn(w, bits=4, group_size=g))).pow(2).mean().item()
            for g in (32, 128, -1)]
    assert errs[0] < errs[1] < errs[2]


def test_rtn_asym_degenerate_groups() -> None:
    w = _weight(8, 64)
    w[0, :32] = w[0, :32].abs() + 0.5  # no negative weight: the zero point must be 0
    w[1, :32] = 0.0  # all zeros: must come back exactly
    qw = quantize_rtn(w, bits=4, group_size=32, sym=False)
    assert int(qw.zeros[0, 0]) == 0
    w_hat = dequantize(qw)
    assert bool((w_hat[1, :32] == 0).all())
    err = (w.double() - w_hat.double()).abs().reshape(8, 2, 32)
    assert bool((err <= qw.scales.double().unsqueeze(-1) / 2 * (1 + 1e-6)).all())
    sym = quantize_rtn(w, bits=4, group_size=32, sym=True)
    assert bool((dequantize(sym)[1, :32] == 0).all())


def test_rtn_rejects_bad_arguments() -> None:
    w = torch.randn(8, 100)
    with pytest.raises(ValueError, match=r"group_size=64 does not divide in_features=100"):
        quantize_rtn(w, group_size=64)
    with pytest.raises(ValueError, match=r"sizes that fit: \[32, 64, 128\]"):
        quantize_rtn(torch.randn(8, 384), group_size=256 + 1)
    with pytest.raises(ValueError, match="positive integer or -1"):
        quantize_rtn(w, group_size=0)
    with pytest.raises(ValueError, match="positive integer or -1"):
        quantize_rtn(w, group_size=-2)
    with pytest.raises(ValueError, match=r"bits must be one of \(4, 8\)"):
        quantize_rtn(torch.randn(8, 128), bits=3)
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_rtn(torch.randn(128), group_size=-1)
    bad = torch.randn(8, 128)
    bad[3, 5] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_rtn(bad)


# ---------------------------------------------------------------- GPTQ layout


GPTQ_CASES = [  # (out_features, in_features, bits, group_size, sym)
    (72, 256, 4, 64, True), (72, 256, 4, 64, False), (64, 128, 4, 32, True),
    (40, 256, 4, 128, False), (72, 256, 4, -1, True), (72, 256, 8, 128, True),
    (36, 192, 8, 64, False), (72, 256, 8, -1, True),
]


@pytest.mark.parametrize("out_features,in_features,bits,group_size,sym", GPTQ_CASES)
def test_gptq_pack_decodes_to_dequantize(out_features: int, in_features: int, bits: int,
                                         group_size: int, sym: bool) -> None:
    qw = quantize_rtn(_weight(out_features, in_features, seed=1), bits, group_size, sym)
    t = pack_gptq(qw)
    pf = 32 // bits
    n_groups = 1 if group_size == -1 else in_features // group_size
    assert t["qweight"].shape == (in_features // pf, out_features)
    assert t["qzeros"].shape == (n_groups, out_features // pf)
    assert t["scales"].shape == (n_groups, out_features)
    assert t["g_idx"].shape == (in_features,)
    assert [t[k].dtype for k in ("qweight", "qzeros", "scales", "g_idx")] == [
        torch.int32, torch.int32, torch.float16, torch.int32]
    assert t["g_idx"].tolist() == [i // (group_size if group_size > 0 else in_features)
                                   for i in range(in_features)]
    assert torch.equal(decode_gptq(t, bits), dequantize(qw).double())


@pytest.mark.parametrize("out_features,in_features,bits,group_size,sym", GPTQ_CASES)
def test_gptq_unpack_round_trip(out_features: int, in_features: int, bits: int,
                                group_size: int, sym: bool) -> None:
    qw = quantize_rtn(_weight(out_features, in_features, seed=2), bits, group_size, sym)
    codes, scales, zeros, g_idx = unpack_gptq(pack_gptq(qw), bits, group_size)
    assert torch.equal(codes, qw.codes)
    assert torch.equal(scales, qw.scales)
    assert torch.equal(zeros, qw.zeros)
    assert torch.equal(g_idx, torch.arange(in_features, dtype=torch.int32) // qw.group_len)
    back = QuantizedWeight(codes, scales, zeros, bits, group_size, sym)
    assert torch.equal(dequantize(back), dequantize(qw))


def test_gptq_v1_sym_zero_point_words() -> None:
    # Every sym checkpoint stores zero - 1 = 7 (4-bit) or 127 (8-bit) in every field.
    t4 = pack_gptq(quantize_rtn(_weight(16, 128), bits=4, group_size=32))
    assert set(t4["qzeros"].flatten().tolist()) == {0x77777777}
    t8 = pack_gptq(quantize_rtn(_weight(16, 128), bits=8, group_size=-1))
    assert set(t8["qzeros"].flatten().tolist()) == {0x7F7F7F7F}


def test_gptq_hand_packed_4bit() -> None:
    # codes[o, i] = (i + 2 o) % 16; input channel i sits at bits 4 i of the word for row o.
    codes = torch.tensor([[(i + 2 * o) % 16 for i in range(8)] for o in range(8)],
                         dtype=torch.uint8)
    scales = torch.tensor([[0.5 * (o + 1)] for o in range(8)], dtype=torch.float16)
    zeros = torch.tensor([[o + 1] for o in range(8)], dtype=torch.int32)  # asym: 1..8
    qw = QuantizedWeight(codes, scales, zeros, bits=4, group_size=8, sym=False)
    t = pack_gptq(qw)
    expected = [0x76543210, 0x98765432, 0xBA987654, 0xDCBA9876,
                0xFEDCBA98, 0x10FEDCBA, 0x3210FEDC, 0x543210FE]
    assert t["qweight"].tolist() == [[_i32(x) for x in expected]]
    assert t["qzeros"].tolist() == [[0x76543210]]  # zero - 1 = 0..7, output o at bits 4 o
    assert t["scales"].tolist() == [[0.5 * (o + 1) for o in range(8)]]
    assert t["g_idx"].tolist() == [0] * 8
    assert torch.equal(decode_gptq(t, 4), dequantize(qw).double())
    assert float(dequantize(qw)[5, 6]) == (0 - 6) * 3.0  # code 0, zero 6, scale 3.0


def test_gptq_hand_packed_8bit() -> None:
    rows = [[0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08],
            [0x80, 0xFF, 0x00, 0x7F, 0x10, 0x20, 0x30, 0x40],
            [0xAA] * 8,
            [0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17]]
    qw = QuantizedWeight(torch.tensor(rows, dtype=torch.uint8),
                         torch.full((4, 1), 0.25, dtype=torch.float16),
                         torch.full((4, 1), 128, dtype=torch.int32), bits=8, group_size=-1,
                         sym=True)
    t = pack_gptq(qw)
    assert t["qweight"].tolist() == [
        [0x04030201, 0x7F00FF80, _i32(0xAAAAAAAA), 0x13121110],
        [0x08070605, 0x40302010, _i32(0xAAAAAAAA), 0x17161514]]
    assert t["qzeros"].tolist() == [[0x7F7F7F7F]]
    assert torch.equal(decode_gptq(t, 8), dequantize(qw).double())


def test_gptq_v1_rejects_zero_point_zero_and_v2_keeps_it() -> None:
    w = _weight(8, 64)
    w[2, :32] = w[2, :32].abs() + 0.1
    qw = quantize_rtn(w, bits=4, group_size=32, sym=False)
    assert int(qw.zeros[2, 0]) == 0
    with pytest.raises(ValueError, match="cannot hold a zero point of 0"):
        pack_gptq(qw)
    t = pack_gptq(qw, checkpoint_format="gptq_v2")
    assert torch.equal(decode_gptq(t, 4, zero_offset=0), dequantize(qw).double())
    _, _, zeros, _ = unpack_gptq(t, 4, 32, checkpoint_format="gptq_v2")
    assert torch.equal(zeros, qw.zeros)


def test_gptq_pack_and_unpack_errors() -> None:
    with pytest.raises(ValueError, match="divisible by 8, got 64 x 36"):
        pack_gptq(quantize_rtn(_weight(36, 64), bits=4, group_size=32))
    with pytest.raises(ValueError, match="divisible by 8, got 36 x 16"):
        pack_gptq(quantize_rtn(_weight(16, 36), bits=4, group_size=-1))
    qw = quantize_rtn(_weight(16, 64), bits=4, group_size=32)
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        pack_gptq(qw, checkpoint_format="gptq_v3")
    fp32 = quantize_rtn(_weight(16, 64), bits=4, group_size=32, scale_dtype=torch.float32)
    with pytest.raises(ValueError, match="not fp16 values"):
        pack_gptq(fp32)
    off_center = QuantizedWeight(qw.codes, qw.scales, qw.zeros - 1, 4, 32, sym=True)
    with pytest.raises(ValueError, match="every zero point at 8"):
        pack_gptq(off_center)
    t = pack_gptq(qw)
    with pytest.raises(ValueError, match="group_size=24 does not divide in_features=64"):
        unpack_gptq(t, 4, 24)
    with pytest.raises(CorruptCheckpointError, match=r"qzeros .* \(2, 2\), expected \(1, 2\)"):
        unpack_gptq(t, 4, -1)
    bad = dict(t, scales=t["scales"][:, :8])
    with pytest.raises(CorruptCheckpointError, match=r"scales .* \(2, 8\), expected \(2, 16\)"):
        unpack_gptq(bad, 4, 32)


def test_gptq_unpack_without_g_idx() -> None:
    qw = quantize_rtn(_weight(16, 128), bits=4, group_size=32)
    t = {k: v for k, v in pack_gptq(qw).items() if k != "g_idx"}
    _, _, _, g_idx = unpack_gptq(t, 4, 32)
    assert g_idx.tolist() == [i // 32 for i in range(128)]


def test_gptq_quantization_config() -> None:
    cfg = gptq_quantization_config(bits=4, group_size=128, sym=True)
    assert {k: cfg[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym",
                                "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
    assert json.loads(json.dumps(cfg)) == cfg
    from transformers import GPTQConfig

    hf = GPTQConfig.from_dict(cfg)
    assert (hf.bits, hf.group_size, hf.sym, hf.desc_act, hf.format) == (4, 128, True, False,
                                                                          "gptq")
    with pytest.raises(ValueError, match="bits in"):
        gptq_quantization_config(bits=3, group_size=128, sym=True)
