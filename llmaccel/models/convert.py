"""A GGUF file as an HF safetensors directory (config.json, model.safetensors, tokenizer), for
tools that take only HF directories (`llmaccel quantize`) or load faster from one."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def gguf_to_hf_dir(gguf: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                   return_model: bool = True):
    """Dequantize `gguf` and write it to `out_dir` in `dtype`; returns (the written model as a
    transformers model in fp32, or None without `return_model`; its tokenizer). The weights
    come through our loader (models/loader.gguf_weights: transformers' GGUF reading and name
    mapping, with models/gguf_loading's one metadata parse and torch dequantization), cast to
    `dtype` as they arrive: no fp32 transformers model of the whole checkpoint is built
    first, as `from_pretrained(gguf_file=...)` did (Qwen2.5-Coder-1.5B to bf16: 107 s before,
    77-83 s after, on 2 cores). The config
    is written without the quantization_config transformers attaches to GGUF models."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from llmaccel.models.config import make_model_config
    from llmaccel.models.loader import gguf_weights
    from llmaccel.models.tokenizer import get_tokenizer

    out = Path(out_dir)
    mc = make_model_config(str(gguf), dtype=dtype)
    tied = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
    state = {name: t.contiguous() for name, t in gguf_weights(mc, torch.device("cpu"))
             if not (tied and name == "lm_head.weight")}  # a tied head: the embedding serves
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    del state
    config = mc.hf_config.to_dict()
    config.pop("quantization_config", None)
    dtype_name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = config["dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(config))
    tok = get_tokenizer(mc)
    if tok is not None:
        tok.save_pretrained(out)
    if not return_model:
        return None, tok
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval(), tok


__all__ = ["gguf_to_hf_dir"]
