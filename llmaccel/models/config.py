"""ModelConfig: the validated description of a model to load (source, config, dtype, length)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from llmaccel.errors import CorruptCheckpointError, LLMAccelError, UnsupportedModelError
from llmaccel.models.layers.quantization import QuantizationConfig
from llmaccel.models.shapes import SHAPES
from llmaccel.models.source import ModelSource, resolve_model_source

logger = logging.getLogger(__name__)

# architecture name -> HF model_type; one Transformer implementation serves all of them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_ARCH_BY_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    source: ModelSource
    hf_config: PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    load_format: str  # resolved: safetensors | gguf | dummy
    # from config.json's quantization_config (packed GPTQ/AWQ/compressed-tensors); None: plain
    quant_config: QuantizationConfig | None = None

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers


def parse_dtype(dtype: str | torch.dtype, hf_config: PretrainedConfig | None = None,
                device: str | torch.device = "cpu") -> torch.dtype:
    """'auto' keeps a checkpoint's half-precision dtype on GPU and uses fp32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        stored = _DTYPES.get(str(stored).removeprefix("torch."), torch.bfloat16)
        return torch.bfloat16 if stored == torch.float32 else stored
    if dtype not in _DTYPES:
        raise LLMAccelError(f"unknown dtype '{dtype}' (use auto, bfloat16, float16 or float32)")
    return _DTYPES[dtype]


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    if source.kind == "shape":
        raw = dict(SHAPES[source.name])
        return AutoConfig.for_model(raw.pop("model_type"), **raw)
    if source.kind == "gguf":
        from llmaccel.models.gguf_loading import fast_gguf

        directory, file = source.gguf_dir_and_file
        try:
            with fast_gguf():  # its metadata parse is kept for the weights' load
                config = AutoConfig.from_pretrained(directory, gguf_file=file)
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot read GGUF file '{source.path}' (corrupt or truncated?): "
                f"{_one_line(e)}") from e
        _check_architecture(_architecture_of(config.to_dict()), source)
        return config
    path = source.path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{path} must hold a JSON object")
    _check_architecture(_architecture_of(raw), source)
    try:
        return AutoConfig.from_pretrained(str(source.path))
    except Exception as e:
        raise CorruptCheckpointError(f"{path} is not a valid model config: {_one_line(e)}") from e


def _architecture_of(raw: dict[str, Any]) -> str | None:
    archs = raw.get("architectures") or []
    if archs:
        return archs[0]
    return _ARCH_BY_MODEL_TYPE.get(raw.get("model_type", ""), raw.get("model_type"))


def _check_architecture(arch: str | None, source: ModelSource) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model '{source.name}' has architecture '{arch}', which llmaccel does not support "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def make_model_config(model: str | None, *, dtype: str | torch.dtype = "auto",
                      max_model_len: int | None = None, load_format: str = "auto",
                      device: str | torch.device = "cpu",
                      hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
    if load_format not in LOAD_FORMATS:
        raise LLMAccelError(f"unknown load_format '{load_format}' (use {', '.join(LOAD_FORMATS)})")
    source = resolve_model_source(model)
    hf_config = load_hf_config(source)
    for key, value in (hf_overrides or {}).items():  # vLLM's --hf-overrides
        setattr(hf_config, key, value)
    arch = _architecture_of(hf_config.to_dict())
    resolved_format = {"hf": "safetensors", "gguf": "gguf", "shape": "dummy"}[source.kind]
    if load_format == "dummy":
        resolved_format = "dummy"
    elif load_format != "auto" and load_format != resolved_format:
        raise LLMAccelError(f"model '{source.name}' is a {source.kind} source and cannot be "
                            f"loaded with load_format='{load_format}'")
    _check_rope(hf_config, source)
    return ModelConfig(source=source, hf_config=hf_config, architecture=arch,
                       dtype=parse_dtype(dtype, hf_config, device),
                       max_model_len=_max_model_len(hf_config, max_model_len),
                       load_format=resolved_format,
                       quant_config=_quant_config(hf_config, resolved_format))


def _quant_config(hf_config: PretrainedConfig, load_format: str) -> QuantizationConfig | None:
    # Safetensors checkpoints hold packed tensors; transformers also sets quantization_config on
    # GGUF configs, whose tensors arrive already dequantized. Dummy weights take a
    # quantization_config given through hf_overrides (random codes, for speed work, as vLLM's
    # dummy loader does for quantized layers).
    if load_format == "gguf" or (load_format == "dummy" and
                                 not getattr(hf_config, "quantization_config", None)):
        return None
    from llmaccel.models.layers.quant_configs import quant_config_from_hf
    return quant_config_from_hf(hf_config)


def _check_rope(hf_config: PretrainedConfig, source: ModelSource) -> None:
    from llmaccel.models.layers.rotary import SUPPORTED_ROPE_TYPES, rope_parameters
    rope_type = rope_parameters(hf_config).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"model '{source.name}' uses rope_type '{rope_type}', which llmaccel does not "
            f"support (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _max_model_len(hf_config: PretrainedConfig, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    # Full attention equals sliding-window attention while the context fits in the window,
    # so capping the length keeps outputs exact without a sliding-window kernel.
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", True)
    if window and uses_window and window < limit:
        logger.warning("sliding_window=%d: capping max_model_len at the window (full "
                       "attention is exact up to it)", window)
        limit = window
    if requested is None:
        return limit
    if requested <= 0 or requested > limit:
        raise LLMAccelError(f"max_model_len={requested} is out of range (1..{limit} for this "
                            "model)")
    return requested
