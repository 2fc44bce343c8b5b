"""FP8 W8A8 checkpoints: compressed-tensors "float-quantized" (llm-compressor's FP8_DYNAMIC) and
vLLM's own `quant_method: "fp8"` (AutoFP8-style, per-tensor scales).

compressed-tensors float-quantized, per quantized Linear with weight [out, in]:

    weight         float8_e4m3fn [out, in]   e4m3(W / weight_scale), saturated to +-448
    weight_scale   float         [out, 1]    strategy "channel" (FP8_DYNAMIC); [1] for "tensor"

Activations have no tensor: `input_activations` says {type float, num_bits 8, strategy token,
dynamic true}, i.e. the reader computes one scale per token at run time. The config block is
what llm-compressor writes for `QuantizationModifier(scheme="FP8_DYNAMIC", ignore=["lm_head"])`.

vLLM fp8 (`quant_method: "fp8"`, `activation_scheme: "dynamic"`): the same `weight`, with a
per-tensor `weight_scale` (shape [] or [1]); `ignored_layers` (or `modules_to_not_convert`) lists
unquantized modules and `weight_block_size` marks DeepSeek-style 128x128 block scales, stored as
`weight_scale_inv`, which we do not read.

Verified against compressed-tensors `quantization/quant_scheme.py` (the FP8_DYNAMIC preset),
`quantization/quant_args.py` (field names; its models forbid unknown keys, so only fields every
release knows are written), `compressors/naive_quantized/base.py` (FloatQuantizationCompressor
stores `weight` in the e4m3 dtype beside `weight_scale`) and `quantization/utils/helpers.py`
(symmetric scale = absmax / 448 for fp8), and vLLM `quantization/fp8.py` (`Fp8Config` keys).
"""

from __future__ import annotations

import torch

from llmaccel.errors import QuantizationError
from llmaccel.quant.fp8 import FP8_DTYPE, Fp8Weight

FP8_FORMAT = "float-quantized"


def _fp8_args(strategy: str, dynamic: bool) -> dict[str, object]:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
            "group_size": None, "dynamic": dynamic, "actorder": None, "block_structure": None}


def fp8_quantization_config(
    *,
    weight_strategy: str = "channel",
    ignore: list[str] | tuple[str, ...] = ("lm_head",),
    targets: list[str] | tuple[str, ...] = ("Linear",),
) -> dict[str, object]:
    """The `quantization_config` block of config.json for an FP8_DYNAMIC (W8A8) model."""
    if weight_strategy not in ("channel", "tensor"):
        raise QuantizationError(f"fp8 weight_strategy must be 'channel' or 'tensor', got "
                                f"{weight_strategy!r}")
    return {
        "quant_method": "compressed-tensors",
        "format": FP8_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": list(targets),
                "weights": _fp8_args(weight_strategy, dynamic=False),
                "input_activations": _fp8_args("token", dynamic=True),
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def pack_fp8(qw: Fp8Weight) -> dict[str, torch.Tensor]:
    """One Linear's tensors as compressed-tensors stores them: `weight` e4m3, `weight_scale`
    fp32 ([out, 1] per channel, [1] per tensor)."""
    if qw.weight.dtype != FP8_DTYPE or qw.weight.dim() != 2:
        raise QuantizationError(f"fp8 weight must be 2-D {FP8_DTYPE}, got {qw.weight.dim()}-D "
                                f"{qw.weight.dtype}")
    expected = (qw.weight.shape[0], 1) if qw.strategy == "channel" else (1,)
    if tuple(qw.weight_scale.shape) != expected:
        raise QuantizationError(f"{qw.strategy} weight_scale must have shape {expected}, got "
                                f"{tuple(qw.weight_scale.shape)}")
    scale = qw.weight_scale.detach().to(torch.float32)
    if not torch.isfinite(scale).all() or bool((scale <= 0).any()):
        raise QuantizationError("fp8 weight_scale must be finite and positive")
    return {"weight": qw.weight.detach().contiguous(), "weight_scale": scale.contiguous()}


__all__ = ["FP8_FORMAT", "fp8_quantization_config", "pack_fp8"]
