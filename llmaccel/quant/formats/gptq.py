"""GPTQ checkpoint layout (`quant_method: gptq`), as AutoGPTQ/GPTQModel write it and vLLM reads it.

Each quantized Linear `<prefix>` is stored as four tensors (pf = 32 // bits codes per int32):

    qweight  int32 [in_features // pf, out_features]  codes packed along in_features: input
             channel i = r * pf + j sits in bits [bits * j, bits * (j + 1)) of qweight[r, o]
    qzeros   int32 [n_groups, out_features // pf]     zero points, packed the same way along
             out_features
    scales   fp16  [n_groups, out_features]
    g_idx    int32 [in_features]                      group of each input channel
                                                      (i // group_size without act-order)

Readers compute W[o, i] = (code - zero) * scales[g_idx[i], o]. With `checkpoint_format: gptq`
(v1) qzeros holds zero - 1 and readers add the 1 back, a quirk kept from the first GPTQ CUDA
kernels; `gptq_v2` (GPTQModel) stores the zero point itself. Words are bit fields: int32 only
types the storage, so a word with the top bit set reads as negative.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from llmaccel.version import __version__
from llmaccel.errors import CorruptCheckpointError, QuantizationError
from llmaccel.quant.rtn import SUPPORTED_BITS, QuantizedWeight, check_group_size
from llmaccel.models.layers.packed_formats import (  # noqa: F401 - read side, shared
    ZERO_OFFSETS,
    pack_factor,
    pack_int32,
    unpack_int32,
)


def _zero_offset(checkpoint_format: str) -> int:
    if checkpoint_format not in ZERO_OFFSETS:
        raise QuantizationError(f"checkpoint_format must be one of {sorted(ZERO_OFFSETS)}, "
                                f"got {checkpoint_format!r}")
    return ZERO_OFFSETS[checkpoint_format]


def pack_gptq(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The `qweight`, `qzeros`, `scales`, `g_idx` tensors of one Linear (names without prefix)."""
    offset = _zero_offset(checkpoint_format)
    pf = pack_factor(qw.bits)
    if qw.in_features % pf or qw.out_features % pf:
        raise QuantizationError(f"GPTQ {qw.bits}-bit packing needs in_features and out_features "
                                f"divisible by {pf}, got {qw.in_features} x {qw.out_features}")
    if qw.sym and bool((qw.zeros != 2 ** (qw.bits - 1)).any()):
        # vLLM's Marlin path never reads qzeros for sym checkpoints: it assumes this value.
        raise QuantizationError("a sym GPTQ weight must have every zero point at "
                                f"{2 ** (qw.bits - 1)}; pass sym=False for other zero points")
    if offset and bool((qw.zeros < offset).any()):
        # zero - 1 = -1 would borrow into the neighbouring field; readers cannot recover it.
        raise QuantizationError(
            "GPTQ v1 (checkpoint_format='gptq') stores zero - 1 and cannot hold a "
            "zero point of 0 (a group with no negative weights); use sym=True or "
            "checkpoint_format='gptq_v2'")
    scales = qw.scales.to(torch.float16)
    if not torch.equal(scales.to(qw.scales.dtype), qw.scales):
        raise QuantizationError(
            "GPTQ stores fp16 scales and these are not fp16 values; quantize with "
            "scale_dtype=torch.float16 so the checkpoint matches dequantize()")
    g_idx = torch.arange(qw.in_features, dtype=torch.int32, device=qw.codes.device) // qw.group_len
    return {
        "qweight": pack_int32(qw.codes.t(), qw.bits, dim=0),
        "qzeros": pack_int32((qw.zeros - offset).t(), qw.bits, dim=1),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def unpack_gptq(tensors: Mapping[str, torch.Tensor], bits: int, group_size: int,
                checkpoint_format: str = "gptq"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Linear's GPTQ tensors -> (codes [out, in] uint8, scales [out, n_groups],
    zeros [out, n_groups] int32, g_idx [in] int32), in `QuantizedWeight` orientation.

    Zero points come back as readers see them (v1: stored + 1), so a third-party v1 field of
    15 reads as 16, exactly as vLLM would use it. A missing g_idx (early GPTQ checkpoints)
    means no act-order. Tensors of the wrong shape raise CorruptCheckpointError.
    """
    offset = _zero_offset(checkpoint_format)
    pf = pack_factor(bits)
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    in_features, out_features = qweight.shape[0] * pf, qweight.shape[1]
    n_groups = in_features // check_group_size(in_features, group_size)
    expected = {"qzeros": (n_groups, out_features // pf), "scales": (n_groups, out_features)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CorruptCheckpointError(
                f"GPTQ {name} has shape {tuple(tensors[name].shape)}, expected {shape} for "
                f"qweight {tuple(qweight.shape)} and group_size={group_size}")
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_features, device=qweight.device) // (in_features // n_groups)
    if tuple(g_idx.shape) != (in_features,):
        raise CorruptCheckpointError(
            f"GPTQ g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
    codes = unpack_int32(qweight, bits, dim=0).t().to(torch.uint8).contiguous()
    zeros = (unpack_int32(qzeros, bits, dim=1) + offset).t().contiguous()
    return codes, scales.t().contiguous(), zeros, g_idx.to(torch.int32)


def gptq_quantization_config(bits: int, group_size: int, sym: bool, desc_act: bool = False,
                             checkpoint_format: str = "gptq", lm_head: bool = False
                             ) -> dict[str, Any]:
    """`quantization_config` for config.json. vLLM's `gptq` reads bits, group_size, desc_act
    (required), lm_head and checkpoint_format; `gptq_marlin` also requires sym; transformers'
    GPTQConfig takes the same keys."""
    _zero_offset(checkpoint_format)
    pack_factor(bits)
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "lm_head": lm_head,
        "checkpoint_format": checkpoint_format,
        "meta": {"quantizer": [f"llmaccel:{__version__}"]},
    }
