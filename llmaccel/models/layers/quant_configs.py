"""QuantizationConfigs read from a checkpoint's config.json `quantization_config` block.

`quant_config_from_hf` maps GPTQ (v1/v2), AWQ GEMM and compressed-tensors pack-quantized to the
linear methods in `llmaccel.models.layers.linear_methods`; anything else is refused with a
QuantizationError naming the offending key, rather than loading packed words as garbage.
Layers the format lists as not converted stay unquantized, and so does lm_head, except in GPTQ
checkpoints with `lm_head: true` (GPTQModel's option, which vLLM's GPTQ methods read too).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from torch import nn

from llmaccel.errors import QuantizationError
from llmaccel.models.layers.quantization import (
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
)
from llmaccel.models.layers.packed_formats import AWQ_BITS, CT_BITS, SUPPORTED_BITS, ZERO_OFFSETS
from llmaccel.models.layers.linear_methods import (
    AWQLinearMethod,
    CompressedTensorsLinearMethod,
    GPTQLinearMethod,
)

logger = logging.getLogger(__name__)

# our fused Linear -> the checkpoint modules stacked in it (see transformer.STACKED_PARAMS)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_module_names(prefix: str) -> list[str]:
    """The checkpoint's module names behind our layer `prefix` (three for a fused q/k/v)."""
    head, _, last = prefix.rpartition(".")
    parts = _FUSED.get(last)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def _key(raw: Mapping[str, Any], key: str, default: Any = None) -> Any:
    return raw.get(key, default)


def _bad(method: str, key: str, value: Any, supported: str) -> QuantizationError:
    return QuantizationError(f"quantization_config.{key}={value!r} is not supported for "
                             f"{method} checkpoints (supported: {supported})")


def _group_size(method: str, value: Any) -> int:
    if value is None:
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or (value <= 0 and value != -1):
        raise _bad(method, "group_size", value, "a positive integer or -1")
    return value


class _PerLayerConfig(QuantizationConfig):
    """Hands a packed method to every layer the checkpoint quantized, a plain one elsewhere."""

    def _method_for(self, prefix: str) -> LinearMethodBase | None:
        """The packed method for a quantized layer, or None to keep it unquantized."""
        raise NotImplementedError

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        is_head = prefix.split(".")[-1] == "lm_head"
        method = None if is_head and not self.quantizes_lm_head else self._method_for(prefix)
        return method or UnquantizedLinearMethod()


class GPTQConfig(_PerLayerConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, sym: bool, desc_act: bool,
                 checkpoint_format: str, lm_head: bool = False) -> None:
        self.bits, self.group_size, self.sym = bits, group_size, sym
        self.desc_act, self.checkpoint_format = desc_act, checkpoint_format
        self.quantizes_lm_head = lm_head

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> GPTQConfig:
        bits = _key(raw, "bits")
        if bits not in SUPPORTED_BITS:
            raise _bad("gptq", "bits", bits, f"{SUPPORTED_BITS}")
        fmt = _key(raw, "checkpoint_format", "gptq")
        if fmt not in ZERO_OFFSETS:
            raise _bad("gptq", "checkpoint_format", fmt, f"{sorted(ZERO_OFFSETS)}")
        lm_head = _key(raw, "lm_head", False)
        if not isinstance(lm_head, bool):
            raise _bad("gptq", "lm_head", lm_head, "true or false")
        for key in ("dynamic", "modules_in_block_to_quantize"):
            if _key(raw, key):
                raise _bad("gptq", key, "<per-module overrides>", "absent")
        return cls(bits, _group_size("gptq", _key(raw, "group_size", 128)),
                   bool(_key(raw, "sym", True)), bool(_key(raw, "desc_act", False)), fmt,
                   lm_head)

    def _method_for(self, prefix: str) -> LinearMethodBase | None:
        return GPTQLinearMethod(self.bits, self.group_size, self.sym, self.checkpoint_format)


class AWQConfig(_PerLayerConfig):
    name = "awq"

    def __init__(self, group_size: int, zero_point: bool, modules_to_not_convert: list[str]):
        self.group_size, self.zero_point = group_size, zero_point
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> AWQConfig:
        bits = _key(raw, "bits", _key(raw, "w_bit"))
        if bits != AWQ_BITS:
            raise _bad("awq", "bits", bits, f"{AWQ_BITS}")
        version = str(_key(raw, "version", "gemm")).lower()
        if version != "gemm":
            raise _bad("awq", "version", version, "'gemm'")
        group = _group_size("awq", _key(raw, "group_size", _key(raw, "q_group_size", 128)))
        return cls(group, bool(_key(raw, "zero_point", True)),
                   list(_key(raw, "modules_to_not_convert") or []))

    def _method_for(self, prefix: str) -> LinearMethodBase | None:
        # transformers and vLLM skip a module when any listed string occurs in its name
        names = checkpoint_module_names(prefix)
        if any(skip in n for n in names for skip in self.modules_to_not_convert):
            return None
        return AWQLinearMethod(AWQ_BITS, self.group_size, not self.zero_point)


def _matches(name: str, patterns: list[str]) -> bool:
    """compressed-tensors' target/ignore matching by module name: exact, `re:` regex, or a
    trailing-name match ("lm_head", "q_proj"); class-name targets are handled by the caller."""
    for pat in patterns:
        if pat.startswith("re:"):
            if re.match(pat[3:], name):
                return True
        elif name == pat or name.endswith("." + pat):
            return True
    return False


class CompressedTensorsConfig(_PerLayerConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[tuple[list[str], int, int, bool]], ignore: list[str]):
        self.schemes = schemes  # (targets, num_bits, group_size, symmetric) per config group
        self.ignore = ignore

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> CompressedTensorsConfig:
        method = "compressed-tensors"
        fmt = _key(raw, "format")
        if fmt != "pack-quantized":
            raise _bad(method, "format", fmt, "'pack-quantized'")
        status = _key(raw, "quantization_status", "compressed")
        if status != "compressed":
            raise _bad(method, "quantization_status", status, "'compressed'")
        if _key(raw, "kv_cache_scheme"):
            raise _bad(method, "kv_cache_scheme", "<set>", "null")
        groups = _key(raw, "config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise _bad(method, "config_groups", groups, "one or more weight-only int groups")
        schemes = [cls._scheme(f"config_groups.{name}", g) for name, g in groups.items()]
        return cls(schemes, list(_key(raw, "ignore") or []))

    @staticmethod
    def _scheme(where: str, group: Mapping[str, Any]) -> tuple[list[str], int, int, bool]:
        method = "compressed-tensors"
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise _bad(method, f"{where}.{key}", "<set>", "null (weight-only)")
        if group.get("format") not in (None, "pack-quantized"):
            raise _bad(method, f"{where}.format", group.get("format"), "'pack-quantized'")
        w = group.get("weights") or {}
        checks = {"num_bits": (w.get("num_bits"), CT_BITS),
                  "type": (w.get("type", "int"), ("int",)),
                  "strategy": (w.get("strategy"), ("group", "channel")),
                  "dynamic": (w.get("dynamic", False), (False,)),
                  "actorder": (w.get("actorder"), (None,)),
                  "block_structure": (w.get("block_structure"), (None,))}
        for key, (value, allowed) in checks.items():
            if value not in allowed:
                raise _bad(method, f"{where}.weights.{key}", value, f"{allowed}")
        group_size = -1 if w["strategy"] == "channel" else _group_size(
            method, w.get("group_size"))
        return (list(group.get("targets") or []), w["num_bits"], group_size,
                bool(w.get("symmetric", True)))

    def _scheme_for(self, name: str) -> tuple[list[str], int, int, bool] | None:
        if _matches(name, self.ignore):
            return None
        for scheme in self.schemes:
            if "Linear" in scheme[0] or _matches(name, scheme[0]):
                return scheme
        return None

    def _method_for(self, prefix: str) -> LinearMethodBase | None:
        names = checkpoint_module_names(prefix)
        schemes = {n: self._scheme_for(n) for n in names}
        if len({id(s) for s in schemes.values()}) > 1:
            raise QuantizationError(f"compressed-tensors: {', '.join(names)} are fused into one "
                                    f"layer here but use different schemes or ignore entries")
        scheme = schemes[names[0]]
        if scheme is None:
            return None
        _, bits, group_size, sym = scheme
        return CompressedTensorsLinearMethod(bits, group_size, sym)


_CONFIGS = {"gptq": GPTQConfig, "awq": AWQConfig, "compressed-tensors": CompressedTensorsConfig}


def quant_config_from_hf(hf_config: Any) -> QuantizationConfig | None:
    """The QuantizationConfig of an HF config (PretrainedConfig or config.json dict), or None
    for an unquantized checkpoint."""
    raw = (hf_config.get("quantization_config") if isinstance(hf_config, Mapping)
           else getattr(hf_config, "quantization_config", None))
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method == "fp8" or (method == "compressed-tensors"
                           and raw.get("format") == "float-quantized"):
        from llmaccel.models.layers.fp8_config import fp8_config_from_hf  # W8A8: its own module

        return fp8_config_from_hf(raw)
    if method == "bitsandbytes":
        from llmaccel.models.layers.bnb_linear import BitsAndBytesConfig  # NF4: its own module

        return BitsAndBytesConfig.from_hf(raw)
    if method not in _CONFIGS:
        raise QuantizationError(f"quantization_config.quant_method={raw.get('quant_method')!r} "
                                f"is not supported (supported: {', '.join(_CONFIGS)})")
    return _CONFIGS[method].from_hf(raw)


def log_linear_methods(model: nn.Module, model_name: str) -> None:
    """One log block per model saying which method each linear layer runs, since a user cannot
    otherwise tell whether a checkpoint ran packed or fell back to plain weights."""
    from llmaccel.models.layers.linear import Linear

    by_method: dict[str, list[str]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Linear):
            method = module.quant_method
            desc = (method.describe(module) if hasattr(method, "describe")
                    else "unquantized")
            # model.layers.3.self_attn.qkv_proj -> self_attn.qkv_proj: the same in every layer
            by_method[desc].append(re.sub(r"^model\.layers\.\d+\.", "", module.prefix))
    for desc, names in by_method.items():
        counts = {n: names.count(n) for n in dict.fromkeys(names)}
        layers = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())
        logger.info("%s: %s: %s", model_name, desc, layers)
