"""AWQ GEMM and compressed-tensors pack-quantized layouts, checked against decoders written here.

The decoders below read the packed int32 words with plain Python integer shifts, straight from
each format's definition (the same definition AutoAWQ's packer and compressed-tensors'
`pack_to_int32` implement); they never call our unpackers, so a mistake shared by our pack and
unpack (the usual way a round-trip test lies) still fails here.
"""

from __future__ import annotations

import pytest
import torch

from llmaccel.errors import CorruptCheckpointError, LLMAccelError
from llmaccel.quant.formats.awq import awq_quantization_config, pack_awq, unpack_awq
from llmaccel.quant.formats.compressed_tensors import (
    compressed_tensors_quantization_config,
    pack_compressed_tensors,
    unpack_compressed_tensors,
)

# AutoAWQ's definition: nibble i of a word holds output feature (8 * word_col + ORDER[i]).
AWQ_NIBBLE_TO_FEATURE = [0, 2, 4, 6, 1, 3, 5, 7]


def _random_layer(out_f: int, in_f: int, group: int, bits: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_groups = in_f // group
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (out_f, in_f), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, top + 1, (out_f, n_groups), generator=g, dtype=torch.int32)
    scales = torch.rand(out_f, n_groups, generator=g) * 0.02 + 1e-3
    return codes, scales, zeros


def _reference_dequant(codes, scales, zeros, group: int) -> torch.Tensor:
    """(codes - zeros) * scales, computed directly in float64 on the unpacked inputs."""
    idx = torch.arange(codes.shape[1]) // group
    return (codes.double() - zeros.double()[:, idx]) * scales.double()[:, idx]


def _u32(word: int) -> int:
    return word & 0xFFFFFFFF  # the int32's bit pattern as a non-negative Python int


# ----------------------------------------------------------------------------- AWQ decoder


def _decode_awq(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """Dequantized W [out, in] from AWQ GEMM tensors, by per-word Python bit arithmetic."""
    in_f, words = qweight.shape
    out_f = words * 8

    def nibbles(mat) -> list[list[int]]:
        rows = []
        for row in mat.tolist():
            feats = [0] * out_f
            for w, word in enumerate(row):
                for i in range(8):
                    feats[8 * w + AWQ_NIBBLE_TO_FEATURE[i]] = (_u32(word) >> (4 * i)) & 0xF
            rows.append(feats)
        return rows  # [rows of mat][out feature]

    q = nibbles(qweight)  # [in][out]
    z = nibbles(qzeros)  # [group][out]
    s = scales.double().tolist()  # [group][out]
    w = [[(q[k][o] - z[k // group][o]) * s[k // group][o] for k in range(in_f)]
         for o in range(out_f)]
    return torch.tensor(w, dtype=torch.float64)


SHAPES = [(24, 128, 32), (72, 128, 64), (24, 256, 128), (72, 256, 32), (8, 128, 128)]


@pytest.mark.parametrize("out_f,in_f,group", SHAPES)
def test_awq_independent_decoder_matches_direct_dequant(out_f, in_f, group):
    codes, scales, zeros = _random_layer(out_f, in_f, group, seed=out_f + in_f + group)
    packed = pack_awq(codes, scales, zeros, group)
    assert packed["qweight"].shape == (in_f, out_f // 8)
    assert packed["qzeros"].shape == (in_f // group, out_f // 8)
    assert packed["scales"].shape == (in_f // group, out_f)
    assert packed["qweight"].dtype == packed["qzeros"].dtype == torch.int32
    assert packed["scales"].dtype == torch.float16
    # AWQ stores fp16 scales, so the direct reference uses the same rounded scales.
    expected = _reference_dequant(codes, scales.half(), zeros, group)
    decoded = _decode_awq(packed["qweight"], packed["qzeros"], packed["scales"], group)
    assert torch.equal(decoded, expected)


@pytest.mark.parametrize("out_f,in_f,group", SHAPES)
def test_awq_round_trip(out_f, in_f, group):
    codes, scales, zeros = _random_layer(out_f, in_f, group, seed=7)
    packed = pack_awq(codes, scales, zeros, group)
    got_codes, got_scales, got_zeros = unpack_awq(**packed, group_size=group)
    assert torch.equal(got_codes.int(), codes)
    assert torch.equal(got_zeros.int(), zeros)
    assert torch.equal(got_scales, scales.half())
    assert got_codes.shape == (out_f, in_f) and got_zeros.shape == (out_f, in_f // group)


def test_awq_hand_worked_example():
    # One block of 8 output features, in_features = 32 = one group of 32.
    # codes[o, k] = [0, 4, 1, 5, 2, 6, 3, 7][o] for every k. Nibble i holds feature
    # ORDER[i] = [0, 2, 4, 6, 1, 3, 5, 7][i], whose code is [0, 1, 2, 3, 4, 5, 6, 7][i] = i, so
    # the nibbles from bit 28 down to bit 0 read 7 6 5 4 3 2 1 0: 0x76543210 = 1985229328.
    # zeros[o, 0] = 15 - o = [15, 14, 13, 12, 11, 10, 9, 8]. Nibble i holds feature ORDER[i]:
    # [15, 13, 11, 9, 14, 12, 10, 8], so from bit 28 down: 8 A C E 9 B D F = 0x8ACE9BDF.
    # Bit 31 is set, so as int32 it is 0x8ACE9BDF - 2^32 = -(0x75316421) = -1966171169.
    codes = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]).unsqueeze(1).expand(8, 32)
    zeros = torch.arange(15, 7, -1).unsqueeze(1)
    scales = torch.full((8, 1), 0.5)
    packed = pack_awq(codes, scales, zeros, 32)
    assert packed["qweight"].tolist() == [[1985229328]] * 32
    assert packed["qzeros"].tolist() == [[-1966171169]]
    assert packed["scales"].tolist() == [[0.5] * 8]


def test_awq_unpack_reads_third_party_words():
    # A word written by hand, read back: 0x87654321 has nibble i = i + 1 (from bit 0 up), so
    # feature ORDER[i] gets i + 1: features 0..7 get [1, 5, 2, 6, 3, 7, 4, 8].
    # 0x87654321 as int32 is 0x87654321 - 2^32 = -(0x789ABCDF) = -2023406815.
    qweight = torch.full((32, 1), -2023406815, dtype=torch.int32)
    qzeros = torch.zeros((1, 1), dtype=torch.int32)
    scales = torch.ones((1, 8), dtype=torch.float16)
    codes, _, zeros = unpack_awq(qweight, qzeros, scales)
    assert codes[:, 0].tolist() == [1, 5, 2, 6, 3, 7, 4, 8]
    assert zeros.tolist() == [[0]] * 8


def test_awq_config():
    assert awq_quantization_config(128) == {
        "quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128,
        "zero_point": True,
    }
    config = awq_quantization_config(64, modules_to_not_convert=["lm_head"])
    assert config["group_size"] == 64 and config["modules_to_not_convert"] == ["lm_head"]


def test_awq_config_parses_in_transformers():
    transformers = pytest.importorskip("transformers")
    parsed = transformers.AwqConfig.from_dict(awq_quantization_config(128))
    assert (parsed.bits, parsed.group_size, parsed.zero_point) == (4, 128, True)
    # transformers 5 reads `version` into `format` (GPTQModel's name for the kernel layout).
    assert str(parsed.to_dict()["format"]).lower() == "gemm"


def test_awq_rejects_unsupported_settings():
    codes, scales, zeros = _random_layer(24, 128, 32)
    with pytest.raises(LLMAccelError, match="4-bit only"):
        pack_awq(codes, scales, zeros, 32, bits=8)
    with pytest.raises(LLMAccelError, match="group_size must be one of"):
        pack_awq(codes, scales[:, :8], zeros[:, :8], 16)
    with pytest.raises(LLMAccelError, match="4-bit only"):
        awq_quantization_config(128, bits=3)
    with pytest.raises(LLMAccelError, match="group_size"):
        awq_quantization_config(-1)


def test_awq_rejects_bad_shapes_and_values():
    codes, scales, zeros = _random_layer(24, 128, 32)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_awq(codes[:20], scales[:20], zeros[:20], 32)
    with pytest.raises(ValueError, match="multiple of group_size"):
        pack_awq(codes[:, :96], scales[:, :3], zeros[:, :3], 64)
    with pytest.raises(ValueError, match="scales must have shape"):
        pack_awq(codes, scales[:, :2], zeros, 32)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_awq(codes + 1, scales, zeros, 32)
    with pytest.raises(ValueError, match="integers"):
        pack_awq(codes, scales, zeros + 0.5, 32)
    packed = pack_awq(codes, scales, zeros, 32)
    with pytest.raises(CorruptCheckpointError, match="int32"):
        unpack_awq(packed["qweight"].long(), packed["qzeros"], packed["scales"])
    with pytest.raises(CorruptCheckpointError, match="shapes disagree"):
        unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"][:, :16])
    with pytest.raises(CorruptCheckpointError, match="group_size=64"):
        unpack_awq(**packed, group_size=64)


# ------------------------------------------------------------- compressed-tensors decoder


def _decode_ct(weight_packed, weight_scale, weight_shape, weight_zero_point, bits: int):
    """Dequantized W [out, in] from pack-quantized tensors, by per-word Python bit arithmetic.

    Definition: fields of `bits` bits, little-endian within each int32, hold the signed value
    plus 2^(bits-1); weights run along the input features, zero points along the output ones.
    """
    out_f, in_f = weight_shape.tolist()
    per_word, mask, offset = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
    group = in_f // weight_scale.shape[1]
    words = weight_packed.tolist()
    zp_words = None if weight_zero_point is None else weight_zero_point.tolist()
    s = weight_scale.double().tolist()
    w = []
    for o in range(out_f):
        row = []
        for k in range(in_f):
            q = ((_u32(words[o][k // per_word]) >> (bits * (k % per_word))) & mask) - offset
            zp = 0
            if zp_words is not None:
                word = _u32(zp_words[o // per_word][k // group])
                zp = ((word >> (bits * (o % per_word))) & mask) - offset
            row.append((q - zp) * s[o][k // group])
        w.append(row)
    return torch.tensor(w, dtype=torch.float64)


CT_CASES = [
    # (out, in, group_size, bits, symmetric)
    (24, 128, 32, 4, True),
    (72, 128, 64, 4, False),
    (24, 256, 128, 4, False),
    (72, 256, 128, 4, True),
    (20, 128, 32, 4, False),  # out not a multiple of 8: zero points get padded
    (24, 128, 64, 8, True),
    (72, 256, 32, 8, False),
    (24, 36, None, 4, True),  # per channel, in not a multiple of 8: weights get padded
    (24, 128, -1, 4, False),
]


def _ct_layer(out_f, in_f, group, bits, symmetric, seed=0):
    width = in_f if group in (None, -1) else group
    codes, scales, zeros = _random_layer(out_f, in_f, width, bits, seed)
    if symmetric:
        zeros = torch.full_like(zeros, 1 << (bits - 1))
    return codes, scales, zeros


@pytest.mark.parametrize("out_f,in_f,group,bits,symmetric", CT_CASES)
def test_ct_independent_decoder_matches_direct_dequant(out_f, in_f, group, bits, symmetric):
    codes, scales, zeros = _ct_layer(out_f, in_f, group, bits, symmetric, seed=out_f + in_f)
    packed = pack_compressed_tensors(
        codes, scales, None if symmetric else zeros,
        num_bits=bits, group_size=group, symmetric=symmetric, scale_dtype=torch.bfloat16,
    )
    per_word = 32 // bits
    n_groups = scales.shape[1]
    assert packed["weight_packed"].dtype == torch.int32
    assert packed["weight_packed"].shape == (out_f, -(-in_f // per_word))
    assert packed["weight_scale"].dtype == torch.bfloat16
    assert packed["weight_scale"].shape == (out_f, n_groups)
    assert packed["weight_shape"].tolist() == [out_f, in_f]
    assert packed["weight_shape"].dtype == torch.int64
    if symmetric:
        assert "weight_zero_point" not in packed
    else:
        zp = packed["weight_zero_point"]
        assert zp.dtype == torch.int32 and zp.shape == (-(-out_f // per_word), n_groups)
    expected = _reference_dequant(codes, scales.bfloat16(), zeros, in_f // n_groups)
    decoded = _decode_ct(
        packed["weight_packed"], packed["weight_scale"], packed["weight_shape"],
        packed.get("weight_zero_point"), bits,
    )
    assert torch.equal(decoded, expected)


@pytest.mark.parametrize("out_f,in_f,group,bits,symmetric", CT_CASES)
def test_ct_round_trip(out_f, in_f, group, bits, symmetric):
    codes, scales, zeros = _ct_layer(out_f, in_f, group, bits, symmetric, seed=3)
    packed = pack_compressed_tensors(
        codes, scales, zeros, num_bits=bits, group_size=group, symmetric=symmetric,
        scale_dtype=torch.float16,
    )
    got_codes, got_scales, got_zeros = unpack_compressed_tensors(**packed, num_bits=bits)
    assert torch.equal(got_codes.int(), codes)
    assert torch.equal(got_zeros.int(), zeros)
    assert torch.equal(got_scales, scales.half())


def test_ct_scales_keep_their_dtype_by_default():
    codes, scales, zeros = _ct_layer(24, 128, 32, 4, True)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        packed = pack_compressed_tensors(codes, scales.to(dtype), group_size=32)
        assert packed["weight_scale"].dtype == dtype
    with pytest.raises(ValueError, match="finite"):
        pack_compressed_tensors(codes, scales * 1e7, group_size=32, scale_dtype=torch.float16)


def test_ct_hand_worked_example_int4():
    # Symmetric int4, out = 2, in = 32, one group of 32. Signed q = code - 8.
    # Row 0: q = 0..7 repeating, stored field = q + 8 = 8..15; field i sits at bits 4i, so from
    #   bit 28 down the word reads F E D C B A 9 8 = 0xFEDCBA98; bit 31 is set, so as int32 it is
    #   0xFEDCBA98 - 2^32 = -(0x01234568) = -19088744.
    # Row 1: q = -8..-1 repeating, fields 0..7: 0x76543210 = 1985229328.
    codes = torch.tensor([[8 + (k % 8) for k in range(32)], [k % 8 for k in range(32)]])
    scales = torch.tensor([[0.25], [2.0]])
    packed = pack_compressed_tensors(codes, scales, num_bits=4, group_size=32, symmetric=True)
    assert packed["weight_packed"].tolist() == [[-19088744] * 4, [1985229328] * 4]
    assert packed["weight_shape"].tolist() == [2, 32]
    assert "weight_zero_point" not in packed

    # Asymmetric: zeros of the 8 output features = 1..8 (signed zp = -7..0), packed along out:
    # field o = zero[o], so from bit 28 down 8 7 6 5 4 3 2 1 = 0x87654321, as int32
    # 0x87654321 - 2^32 = -(0x789ABCDF) = -2023406815.
    codes = torch.full((8, 32), 3)
    zeros = torch.arange(1, 9).unsqueeze(1)
    packed = pack_compressed_tensors(
        codes, torch.ones(8, 1), zeros, num_bits=4, group_size=32, symmetric=False
    )
    assert packed["weight_zero_point"].tolist() == [[-2023406815]]
    assert packed["weight_packed"].tolist() == [[0x33333333] * 4] * 8


def test_ct_hand_worked_example_int8():
    # Symmetric int8: 4 fields of 8 bits per word, field = q + 128. q = [1, 2, -1, -128] gives
    # fields [129, 130, 127, 0]: 129 + 130 * 2^8 + 127 * 2^16 + 0 * 2^24
    # = 129 + 33280 + 8323072 = 8356481 (positive: the top field is 0).
    codes = torch.tensor([[129, 130, 127, 0] * 8])
    packed = pack_compressed_tensors(
        codes, torch.ones(1, 1), num_bits=8, group_size=32, symmetric=True
    )
    assert packed["weight_packed"].tolist() == [[8356481] * 8]


def test_ct_config():
    config = compressed_tensors_quantization_config(4, 128, symmetric=True)
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "pack-quantized"
    assert config["quantization_status"] == "compressed"
    assert config["ignore"] == ["lm_head"]
    group = config["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["input_activations"] is None and group["output_activations"] is None
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (4, "int", True)
    assert (weights["strategy"], weights["group_size"]) == ("group", 128)
    channel = compressed_tensors_quantization_config(8, -1, symmetric=False)
    weights = channel["config_groups"]["group_0"]["weights"]
    assert (weights["strategy"], weights["group_size"], weights["symmetric"]) == (
        "channel", None, False)


def test_ct_config_validates_in_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.quantization")
    for args in [(4, 128, True), (4, 32, False), (8, None, True)]:
        ct.QuantizationConfig.model_validate(compressed_tensors_quantization_config(*args))


def test_ct_rejects_unsupported_settings():
    codes, scales, zeros = _random_layer(24, 128, 32)
    with pytest.raises(LLMAccelError, match="num_bits"):
        pack_compressed_tensors(codes, scales, zeros, num_bits=3, group_size=32, symmetric=False)
    with pytest.raises(LLMAccelError, match="group_size must be one of"):
        pack_compressed_tensors(
            codes, scales[:, :8], zeros[:, :8], group_size=16, symmetric=False
        )
    with pytest.raises(LLMAccelError, match="num_bits"):
        compressed_tensors_quantization_config(2, 128)
    with pytest.raises(LLMAccelError, match="num_bits"):
        unpack_compressed_tensors(
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), (1, 8), num_bits=2
        )


def test_ct_rejects_bad_inputs():
    codes, scales, zeros = _random_layer(24, 128, 32)
    with pytest.raises(ValueError, match="must all be 8"):
        pack_compressed_tensors(codes, scales, zeros, group_size=32, symmetric=True)
    with pytest.raises(ValueError, match="needs zeros"):
        pack_compressed_tensors(codes, scales, None, group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="multiple of group_size"):
        pack_compressed_tensors(codes[:, :96], scales, zeros, group_size=64, symmetric=False)
    with pytest.raises(ValueError, match="scales must have shape"):
        pack_compressed_tensors(codes, scales[:, :2], zeros, group_size=32, symmetric=False)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_compressed_tensors(codes * 2, scales, zeros, group_size=32, symmetric=False)
    packed = pack_compressed_tensors(codes, scales, zeros, group_size=32, symmetric=False)
    with pytest.raises(CorruptCheckpointError, match="weight_packed must be int32"):
        unpack_compressed_tensors(
            packed["weight_packed"].long(), packed["weight_scale"], packed["weight_shape"]
        )
    with pytest.raises(CorruptCheckpointError, match="weight_packed must be int32"):
        unpack_compressed_tensors(packed["weight_packed"], packed["weight_scale"], (24, 256))
    with pytest.raises(CorruptCheckpointError, match="weight_zero_point"):
        unpack_compressed_tensors(
            packed["weight_packed"], packed["weight_scale"], packed["weight_shape"],
            packed["weight_zero_point"][:, :2],
        )
