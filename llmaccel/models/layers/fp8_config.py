"""QuantizationConfigs for FP8 W8A8 checkpoints (see `llmaccel.quant.formats.fp8`).

Two spellings of the same scheme are read:
  - compressed-tensors `format: "float-quantized"`: weights {type float, num_bits 8, strategy
    channel | tensor, static}, input_activations {type float, num_bits 8, strategy token,
    dynamic} (llm-compressor's FP8_DYNAMIC);
  - vLLM's `quant_method: "fp8"` with `activation_scheme: "dynamic"` and per-tensor scales.
Static activation scales, block scales and weight-only FP8 are refused with a QuantizationError
naming the key, rather than run with a different scheme than the checkpoint was made for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmaccel.errors import QuantizationError
from llmaccel.models.layers.quantization import LinearMethodBase, QuantizationConfig
from llmaccel.models.layers.fp8_linear import Fp8LinearMethod
from llmaccel.models.layers.quant_configs import (
    _bad,
    _matches,
    _PerLayerConfig,
    checkpoint_module_names,
)

_CT = "compressed-tensors"


def _check_fields(where: str, args: Any, allowed: dict[str, tuple[Any, tuple]], what: str
                  ) -> None:
    """Each key of `allowed` maps to (compressed-tensors' default, the values we run)."""
    if not isinstance(args, Mapping):
        raise _bad(_CT, where, args, what)
    for key, (default, values) in allowed.items():
        value = args.get(key, default)
        if value not in values:
            raise _bad(_CT, f"{where}.{key}", value, f"{values}: {what}")


class Fp8Config(_PerLayerConfig):
    """Per-layer Fp8LinearMethod; `ignore` entries (exact, suffix or `re:`) stay unquantized."""

    def __init__(self, name: str, schemes: list[tuple[list[str], str]], ignore: list[str]):
        self.name = name
        self.schemes = schemes  # (targets, weight strategy) per config group
        self.ignore = ignore

    @classmethod
    def from_compressed_tensors(cls, raw: Mapping[str, Any]) -> Fp8Config:
        status = raw.get("quantization_status", "compressed")
        if status != "compressed":
            raise _bad(_CT, "quantization_status", status, "'compressed'")
        if raw.get("kv_cache_scheme"):
            raise _bad(_CT, "kv_cache_scheme", "<set>", "null")
        groups = raw.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise _bad(_CT, "config_groups", groups, "one or more FP8_DYNAMIC groups")
        schemes = [cls._scheme(f"config_groups.{name}", g) for name, g in groups.items()]
        return cls(_CT, schemes, list(raw.get("ignore") or []))

    @staticmethod
    def _scheme(where: str, group: Mapping[str, Any]) -> tuple[list[str], str]:
        w = group.get("weights")
        if isinstance(w, Mapping) and w.get("type", "int") != "float":
            # an int scheme under format float-quantized: one of the two keys is wrong
            raise QuantizationError(
                f"quantization_config.{where}.weights.type={w.get('type', 'int')!r} does not "
                f"match format='float-quantized' (supported: float, num_bits 8)")
        if group.get("format") not in (None, "float-quantized"):
            raise _bad(_CT, f"{where}.format", group.get("format"), "'float-quantized'")
        _check_fields(f"{where}.weights", w, {
            "num_bits": (8, (8,)), "type": ("int", ("float",)),
            "strategy": (None, ("channel", "tensor", None)), "symmetric": (True, (True,)),
            "dynamic": (False, (False,)), "group_size": (None, (None, -1)),
            "block_structure": (None, (None,)), "actorder": (None, (None,))},
            "E4M3 weights with per-channel or per-tensor scales")
        # compressed-tensors infers a missing strategy from group_size: -1 channel, None tensor
        strategy = w.get("strategy") or ("channel" if w.get("group_size") == -1 else "tensor")
        acts = group.get("input_activations")
        if acts is None:
            raise _bad(_CT, f"{where}.input_activations", None,
                       "dynamic per-token FP8 (weight-only FP8 is not implemented)")
        _check_fields(f"{where}.input_activations", acts, {
            "dynamic": (False, (True,)), "num_bits": (8, (8,)), "type": ("int", ("float",)),
            "strategy": (None, ("token",)), "symmetric": (True, (True,)),
            "group_size": (None, (None,)), "block_structure": (None, (None,))},
            "dynamic per-token FP8; static activation scales are not implemented")
        if group.get("output_activations"):
            raise _bad(_CT, f"{where}.output_activations", "<set>", "null")
        return list(group.get("targets") or []), strategy

    @classmethod
    def from_vllm_fp8(cls, raw: Mapping[str, Any]) -> Fp8Config:
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise _bad("fp8", "activation_scheme", scheme,
                       "'dynamic'; static input scales are not implemented")
        if raw.get("weight_block_size") is not None:
            raise _bad("fp8", "weight_block_size", raw.get("weight_block_size"),
                       "null (per-tensor scales); block-wise FP8 scales are not implemented")
        if raw.get("kv_cache_scheme"):
            raise _bad("fp8", "kv_cache_scheme", "<set>", "null")
        ignore = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
        return cls("fp8", [(["Linear"], "tensor")], ["lm_head", *ignore])

    def _scheme_for(self, name: str) -> tuple[list[str], str] | None:
        if _matches(name, self.ignore):
            return None
        for scheme in self.schemes:
            if "Linear" in scheme[0] or _matches(name, scheme[0]):
                return scheme
        return None

    def _method_for(self, prefix: str) -> LinearMethodBase | None:
        names = checkpoint_module_names(prefix)
        schemes = [self._scheme_for(n) for n in names]
        if any(s is not schemes[0] for s in schemes):
            raise QuantizationError(f"{self.name}: {', '.join(names)} are fused into one layer "
                                    "here but use different schemes or ignore entries")
        return None if schemes[0] is None else Fp8LinearMethod(schemes[0][1])


def fp8_config_from_hf(raw: Mapping[str, Any]) -> QuantizationConfig:
    """An Fp8Config from a compressed-tensors float-quantized or a vLLM fp8 block."""
    if str(raw.get("quant_method", "")).lower() == "fp8":
        return Fp8Config.from_vllm_fp8(raw)
    return Fp8Config.from_compressed_tensors(raw)


__all__ = ["Fp8Config", "fp8_config_from_hf"]
