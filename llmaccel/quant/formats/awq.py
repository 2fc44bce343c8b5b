"""AWQ "GEMM" checkpoint layout: what AutoAWQ writes (`version: gemm`) and vLLM's AWQ loader reads.

One quantized Linear with weight W [out, in] and groups of `group_size` input features, dequantized
as W[o, k] = (code[o, k] - zero[o, k // g]) * scale[o, k // g], is stored as three tensors:

    qweight  int32 [in, out // 8]            8 four-bit codes of 8 neighbouring output features
    qzeros   int32 [in // g, out // 8]       the zero points, packed exactly like qweight
    scales   fp16  [in // g, out]            one scale per (group, output feature)

Unlike GPTQ v1, the zero points are stored as they are (no off-by-one). Unlike GPTQ and
compressed-tensors, the packing runs along the OUTPUT features, and in AWQ's interleaved order:
within a block of 8 output features, nibble i (bits 4i..4i+3) holds feature AWQ_PACK_ORDER[i];
read the other way round, feature j sits in nibble AWQ_UNPACK_ORDER[j] (vLLM's name for it is
AWQ_REVERSE_ORDER). The order exists for AWQ's CUDA dequantization; we only reproduce it.

Verified against AutoAWQ `awq/modules/linear/gemm.py` (WQLinear_GEMM.from_linear: nibble i gets
`intweight[:, col * 8 + order_map[i]]`, order_map = [0, 2, 4, 6, 1, 3, 5, 7]) and vLLM's AWQ
dequantization (unpack nibbles in shift order, then index with [0, 4, 1, 5, 2, 6, 3, 7]).
"""

from __future__ import annotations

import torch

from llmaccel.errors import CorruptCheckpointError, QuantizationError
from llmaccel.quant.formats.common import as_codes
from llmaccel.models.layers.packed_formats import (  # noqa: F401 - read side, shared
    AWQ_BITS,
    AWQ_PACK_FACTOR,
    AWQ_PACK_ORDER,
    AWQ_UNPACK_ORDER,
    _NIBBLE_MAX,
    _unpack_rows,
    unpack_awq,
)

AWQ_GROUP_SIZES = (32, 64, 128)


def awq_quantization_config(
    group_size: int = 128,
    zero_point: bool = True,
    *,
    bits: int = AWQ_BITS,
    modules_to_not_convert: list[str] | None = None,
) -> dict[str, object]:
    """The `quantization_config` block of config.json for an AWQ GEMM checkpoint.

    `zero_point=True` is what AutoAWQ writes and what vLLM needs to pick its Marlin AWQ kernel;
    the tensors always carry qzeros either way (a symmetric quantizer writes zeros of 8).
    """
    check_awq_settings(bits, group_size)
    config: dict[str, object] = {
        "quant_method": "awq",
        "version": "gemm",
        "bits": bits,
        "group_size": group_size,
        "zero_point": zero_point,
    }
    if modules_to_not_convert:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return config


def check_awq_settings(bits: int, group_size: int) -> None:
    """Reject settings the AWQ GEMM layout cannot express, with a message a user can act on."""
    if bits != AWQ_BITS:
        raise QuantizationError(f"AWQ GEMM checkpoints are 4-bit only, got bits={bits}")
    if group_size not in AWQ_GROUP_SIZES:
        raise QuantizationError(
            f"AWQ GEMM group_size must be one of {AWQ_GROUP_SIZES}, got {group_size}"
        )


def pack_awq(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    *,
    bits: int = AWQ_BITS,
) -> dict[str, torch.Tensor]:
    """Pack one layer's unsigned codes [out, in], scales and zeros [out, in // group_size].

    Returns {"qweight", "qzeros", "scales"} in the AWQ GEMM layout (see the module docstring).
    """
    check_awq_settings(bits, group_size)
    _check_shapes(codes, scales, zeros, group_size)
    qweight = _pack_rows(as_codes(codes, "codes", AWQ_BITS).t())
    qzeros = _pack_rows(as_codes(zeros, "zeros", AWQ_BITS).t())
    scales16 = scales.detach().t().to(torch.float16).contiguous()
    if not torch.isfinite(scales16).all():
        raise QuantizationError("AWQ stores scales in fp16; some scales are not finite in fp16")
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales16}


def _check_shapes(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> None:
    if codes.dim() != 2:
        raise QuantizationError(f"codes must be 2-D [out, in], got shape {tuple(codes.shape)}")
    out_features, in_features = codes.shape
    if out_features % AWQ_PACK_FACTOR != 0:
        raise QuantizationError(
            f"AWQ packs 8 output features per int32: out_features={out_features} "
            "is not a multiple of 8"
        )
    if in_features % group_size != 0:
        raise QuantizationError(
            f"in_features={in_features} is not a multiple of group_size={group_size}"
        )
    expected = (out_features, in_features // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != expected:
            raise QuantizationError(f"{name} must have shape {expected}, got {tuple(t.shape)}")


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int64 [rows, cols] nibbles -> int32 [rows, cols // 8] in AWQ's interleaved nibble order."""
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // AWQ_PACK_FACTOR, AWQ_PACK_FACTOR)
    blocks = blocks[..., list(AWQ_PACK_ORDER)]
    shifts = torch.arange(AWQ_PACK_FACTOR, device=values.device, dtype=torch.int64) * AWQ_BITS
    words = (blocks << shifts).sum(dim=-1)
    return _to_int32(words)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the int32 with the same bits.

    A word whose top nibble is 8 or more is negative as int32; casting an out-of-range int64
    is not defined behaviour, so wrap it by hand.
    """
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).contiguous()
