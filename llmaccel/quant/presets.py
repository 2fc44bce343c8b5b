"""Named quantization schemes (the `config.quantization` names of docs/workloads.md) as the
config.json `quantization_config` a checkpoint in that scheme carries.

Used to run dummy-weight models in a scheme (`LLM(shape, load_format="dummy",
hf_overrides={"quantization_config": preset_config(name)})`, as vLLM's dummy loader does with a
quantized config) so kernels can be timed without quantizing a checkpoint first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmaccel.errors import QuantizationError


def _gptq(bits: int, group: int, lm_head: bool = False) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        from llmaccel.quant.formats.gptq import gptq_quantization_config
        return gptq_quantization_config(bits, group, True, lm_head=lm_head)
    return make


def _awq(group: int) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        from llmaccel.quant.formats.awq import awq_quantization_config
        return awq_quantization_config(group, zero_point=True)
    return make


def _ct(bits: int, group: int, sym: bool) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        from llmaccel.quant.formats.compressed_tensors import (
            compressed_tensors_quantization_config,
        )
        return compressed_tensors_quantization_config(bits, group, sym)
    return make


def _fp8() -> dict[str, Any]:
    from llmaccel.quant.formats.fp8 import fp8_quantization_config
    return fp8_quantization_config()


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "rtn-int8": _ct(8, -1, True),
    "rtn-int4-g128": _ct(4, 128, True),
    "hqq-int4": _ct(4, 64, False),
    "gptq-int4-g128": _gptq(4, 128),
    # the LM head in int4 too (`lm_head: true`, GPTQModel's option; vLLM reads it)
    "gptq-int4-g128-lm-head": _gptq(4, 128, lm_head=True),
    "awq-int4-g128": _awq(128),
    "fp8": _fp8,
}


def preset_config(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise QuantizationError(f"unknown quantization scheme '{name}' "
                                f"(known: {', '.join(PRESETS)})")
    return PRESETS[name]()
