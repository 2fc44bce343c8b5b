"""bitsandbytes 4-bit (NF4) checkpoint layout, as transformers saves a `load_in_4bit` model and
transformers / vLLM load it back (`quant_method: bitsandbytes`).

Each quantized Linear `<prefix>` with weight [out, in] (n = out * in elements) is four tensors:

    <prefix>.weight                                 uint8 [ceil(n / 2), 1]  two codes per byte
    <prefix>.weight.absmax                          fp32 [ceil(n / blocksize)]
    <prefix>.weight.quant_map                       fp32 [16]  the code book (NF4 values)
    <prefix>.weight.quant_state.bitsandbytes__nf4   uint8 [len]  UTF-8 JSON of the rest:
        {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [out, in]}

Codes are taken from the row-major flattened weight, and element 2j sits in the HIGH nibble of
byte j, element 2j + 1 in the low nibble (an odd count is padded with one code). `dtype` is the
dtype readers dequantize to. Double quantization would add `weight.nested_absmax` and
`weight.nested_quant_map` (absmax itself 8-bit quantized); we neither write nor read it.

Verified against bitsandbytes 0.50 (`functional.QuantState.as_dict(packed=True)`, its
`pack_dict_to_tensor`, and the reference `quantize_4bit` / `dequantize_4bit` ops, which put
element 2j in `byte >> 4`), transformers' `BitsAndBytesConfig.to_dict()` and its 4-bit
quantizer's list of checkpoint keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from llmaccel.errors import CorruptCheckpointError, QuantizationError
from llmaccel.quant.nf4 import NF4_ZERO_CODE, NF4Weight, check_blocksize
from llmaccel.models.layers.packed_formats import (  # noqa: F401 - read side, shared
    ABSMAX,
    DTYPES,
    NESTED,
    QUANT_MAP,
    QUANT_STATE,
    QUANT_STATE_PREFIX,
    _DTYPE_NAMES,
    check_nf4_state,
    parse_quant_state,
    unpack_nibbles,
)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (any shape, flattened row-major) -> uint8 [ceil(n / 2), 1], first code of
    each pair in the high nibble."""
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() and int(flat.max()) > 15:
        raise QuantizationError("NF4 codes must lie in 0..15")
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_full((1,), NF4_ZERO_CODE)])
    return ((flat[0::2] << 4) | flat[1::2]).unsqueeze(1).contiguous()


def quant_state_tensor(state: Mapping[str, Any]) -> torch.Tensor:
    """A JSON dict as the uint8 tensor bitsandbytes stores it under quant_state.*."""
    return torch.tensor(list(json.dumps(dict(state)).encode("utf-8")), dtype=torch.uint8)


def pack_bnb_nf4(qw: NF4Weight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The four tensors of one Linear, named relative to `<prefix>.` ("weight", ...).
    `dtype` is the model's dtype, recorded for readers to dequantize to."""
    check_blocksize(qw.blocksize)
    if dtype not in _DTYPE_NAMES:
        raise QuantizationError(f"bitsandbytes records float16, bfloat16 or float32, got {dtype}")
    n = qw.codes.numel()
    if qw.absmax.numel() != -(-n // qw.blocksize):
        raise QuantizationError(f"{qw.absmax.numel()} absmax values for {n} elements in blocks "
                                f"of {qw.blocksize}")
    state = {"quant_type": "nf4", "blocksize": qw.blocksize, "dtype": _DTYPE_NAMES[dtype],
             "shape": list(qw.shape)}
    return {
        "weight": pack_nibbles(qw.codes),
        "weight" + ABSMAX: qw.absmax.to(torch.float32).contiguous(),
        "weight" + QUANT_MAP: qw.quant_map.to(torch.float32).contiguous(),
        "weight" + QUANT_STATE: quant_state_tensor(state),
    }


def unpack_bnb_nf4(tensors: Mapping[str, torch.Tensor]) -> tuple[NF4Weight, torch.dtype]:
    """One Linear's tensors (names relative to `<prefix>.`) -> (NF4Weight, recorded dtype)."""
    missing = [k for k in ("weight", "weight" + ABSMAX, "weight" + QUANT_MAP,
                           "weight" + QUANT_STATE) if k not in tensors]
    if missing:
        raise CorruptCheckpointError(f"bitsandbytes NF4 weight lacks {missing[0]}")
    blocksize, shape, dtype = check_nf4_state(parse_quant_state(tensors["weight" + QUANT_STATE]))
    n = 1
    for d in shape:
        n *= d
    absmax, quant_map = tensors["weight" + ABSMAX], tensors["weight" + QUANT_MAP]
    if absmax.numel() != -(-n // blocksize):
        raise CorruptCheckpointError(f"absmax has {absmax.numel()} values, expected "
                                     f"{-(-n // blocksize)} for shape {shape}, blocksize "
                                     f"{blocksize}")
    if quant_map.numel() != 16:
        raise CorruptCheckpointError(f"quant_map has {quant_map.numel()} values, expected 16")
    codes = unpack_nibbles(tensors["weight"], n).reshape(shape)
    return NF4Weight(codes=codes, absmax=absmax.reshape(-1).to(torch.float32),
                     blocksize=blocksize, quant_map=quant_map.reshape(-1).to(torch.float32)), dtype


def bnb_quantization_config(compute_dtype: torch.dtype,
                            skip_modules: list[str] | None = None) -> dict[str, Any]:
    """config.json's `quantization_config`: the keys of transformers' BitsAndBytesConfig
    (all of which vLLM's bitsandbytes config reads), NF4 without double quantization."""
    if compute_dtype not in _DTYPE_NAMES:
        raise QuantizationError(f"bnb_4bit_compute_dtype must be a float dtype, got "
                                f"{compute_dtype}")
    return {
        "quant_method": "bitsandbytes",
        "_load_in_8bit": False,
        "_load_in_4bit": True,
        "load_in_8bit": False,
        "load_in_4bit": True,
        "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": skip_modules,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": False,
        "bnb_4bit_compute_dtype": _DTYPE_NAMES[compute_dtype],
        "bnb_4bit_quant_storage": "uint8",
    }
