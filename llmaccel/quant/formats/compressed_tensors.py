"""compressed-tensors "pack-quantized" layout (int4/int8 weight-only), as llm-compressor writes it
and vLLM's CompressedTensorsWNA16 scheme reads it.

compressed-tensors thinks in signed integers: q in [-2^(b-1), 2^(b-1) - 1], zero point zp in the
same range, W = (q - zp) * scale. It stores q + 2^(b-1) as an unsigned b-bit field, so with our
unsigned codes (code = q + 2^(b-1), zero = zp + 2^(b-1)) the stored fields ARE our codes and
zeros. vLLM names the two cases uint4b8 / uint8b128 (symmetric, bias 8 / 128) and uint4 / uint8
(asymmetric, explicit zero points).

Per quantized Linear with weight [out, in], n_groups = in // group_size (1 for "channel"):

    weight_packed      int32 [out, ceil(in / p)]   p = 32 // bits codes per word, packed along
                                                   the INPUT features, little-endian: code of
                                                   column p*w + i sits at bits [i*b, (i+1)*b)
    weight_scale       float [out, n_groups]       the model's dtype (bf16 for most models)
    weight_shape       int64 [2]                   (out, in), so padding can be cut off again
    weight_zero_point  int32 [ceil(out / p), n_groups]   asymmetric only: packed the same way
                                                   but along the OUTPUT features (dim 0)

Symmetric checkpoints carry no zero point; it is implied (q has zero point 0, i.e. zero = 2^(b-1)).

Verified against compressed-tensors `compressors/pack_quantized/base.py` and its
`pack_to_int32` / `unpack_from_int32` helpers, `compressors/quantized_compressors/base.py`
(symmetric zero points are dropped), `quantization/quant_config.py`, `quant_scheme.py` and
`quant_args.py` (config field names; the scheme and args models forbid unknown keys), and vLLM
`compressed_tensors/schemes/compressed_tensors_wNa16.py` (tensor shapes, uint4b8 vs uint4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmaccel.errors import CorruptCheckpointError, QuantizationError
from llmaccel.quant.formats.common import as_codes
from llmaccel.models.layers.packed_formats import (  # noqa: F401 - read side, shared
    CT_BITS,
    _check_int32,
    _unpack_cols,
    unpack_compressed_tensors,
)

CT_GROUP_SIZES = (32, 64, 128)
# group_size None or -1 (llmaccel.quant's spelling) means one group per output channel: the
# "channel" strategy, one scale column.


def compressed_tensors_quantization_config(
    num_bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    *,
    ignore: list[str] | tuple[str, ...] = ("lm_head",),
    targets: list[str] | tuple[str, ...] = ("Linear",),
) -> dict[str, object]:
    """The `quantization_config` block of config.json for a pack-quantized W4A16/W8A16 model.

    Only fields that every compressed-tensors release knows are written: its scheme and args
    models reject unknown keys, so a newer-only field would break loading with older versions.
    """
    check_ct_settings(num_bits, group_size)
    per_channel = group_size is None or group_size == -1
    weights = {
        "num_bits": num_bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "channel" if per_channel else "group",
        "group_size": None if per_channel else group_size,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": list(targets),
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def check_ct_settings(num_bits: int, group_size: int | None) -> None:
    """Reject settings we do not write, with a message a user can act on."""
    if num_bits not in CT_BITS:
        raise QuantizationError(f"pack-quantized supports num_bits {CT_BITS}, got {num_bits}")
    if group_size is not None and group_size != -1 and group_size not in CT_GROUP_SIZES:
        raise QuantizationError(
            f"pack-quantized group_size must be one of {CT_GROUP_SIZES}, or -1/None for one "
            f"group per channel, got {group_size}"
        )


def pack_compressed_tensors(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    num_bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Pack one layer's unsigned codes [out, in], scales and zeros [out, n_groups].

    Symmetric: `zeros` may be omitted; if given it must be 2^(bits-1) everywhere, since the format
    has nowhere to put anything else. Asymmetric: `zeros` is required and written packed.
    weight_scale is stored in the model's dtype by llm-compressor (bf16 for most models);
    `scale_dtype=None` keeps the scales' own dtype, which avoids re-rounding scales that the
    quantizer already rounded to the model's dtype.
    """
    check_ct_settings(num_bits, group_size)
    if codes.dim() != 2:
        raise QuantizationError(f"codes must be 2-D [out, in], got shape {tuple(codes.shape)}")
    out_features, in_features = codes.shape
    n_groups = _n_groups(in_features, group_size)
    if tuple(scales.shape) != (out_features, n_groups):
        raise QuantizationError(
            f"scales must have shape {(out_features, n_groups)}, got {tuple(scales.shape)}"
        )
    packed_zeros = _pack_zeros(zeros, (out_features, n_groups), num_bits, symmetric)
    weight_scale = scales.detach().to(scale_dtype or scales.dtype).contiguous()
    if not weight_scale.is_floating_point() or not torch.isfinite(weight_scale).all():
        raise QuantizationError(f"scales must be finite floats in {weight_scale.dtype}")
    tensors = {
        "weight_packed": _pack_cols(as_codes(codes, "codes", num_bits), num_bits),
        "weight_scale": weight_scale,
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if packed_zeros is not None:
        tensors["weight_zero_point"] = packed_zeros
    return tensors


def _pack_zeros(
    zeros: torch.Tensor | None, shape: tuple[int, int], num_bits: int, symmetric: bool
) -> torch.Tensor | None:
    """The packed weight_zero_point [ceil(out / p), n_groups], or None for symmetric layers."""
    midpoint = 1 << (num_bits - 1)
    if zeros is None:
        if symmetric:
            return None
        raise QuantizationError("asymmetric pack-quantized needs zeros")
    if tuple(zeros.shape) != shape:
        raise QuantizationError(f"zeros must have shape {shape}, got {tuple(zeros.shape)}")
    zeros = as_codes(zeros, "zeros", num_bits)
    if symmetric:
        if not bool((zeros == midpoint).all()):
            raise QuantizationError(
                f"symmetric pack-quantized stores no zero point, so zeros must all be {midpoint}; "
                "pass symmetric=False to store them"
            )
        return None
    # Packed along the output features (dim 0), unlike the weight.
    return _pack_cols(zeros.t(), num_bits).t().contiguous()


def _n_groups(in_features: int, group_size: int | None) -> int:
    if group_size is None or group_size == -1:
        return 1
    if in_features % group_size != 0:
        raise QuantizationError(
            f"in_features={in_features} is not a multiple of group_size={group_size}")
    return in_features // group_size


def _pack_cols(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int64 [rows, cols] codes -> int32 [rows, ceil(cols / p)], little-endian within a word.

    Columns are zero-padded up to a multiple of p, as compressed-tensors does; weight_shape
    records the true width.
    """
    per_word = 32 // num_bits
    rows, cols = values.shape
    values = F.pad(values, (0, -cols % per_word))
    blocks = values.reshape(rows, -1, per_word)
    shifts = torch.arange(per_word, device=values.device, dtype=torch.int64) * num_bits
    words = (blocks << shifts).sum(dim=-1)
    # A top field of 2^(b-1) or more sets bit 31: wrap to the int32 with the same bits by hand,
    # since casting an out-of-range int64 is not defined behaviour.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).contiguous()


