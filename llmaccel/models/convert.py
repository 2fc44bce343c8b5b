"""A GGUF file as an HF safetensors directory (config.json, model.safetensors, tokenizer), for
tools that take only HF directories (`llmaccel quantize`) or load faster from one."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def gguf_to_hf_dir(gguf: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32):
    """Dequantize `gguf` through transformers and write it to `out_dir` in `dtype`; returns
    (the transformers model in fp32, its tokenizer). transformers keeps GGUF weights packed
    and refuses `save_pretrained` on such a model, so the state dict and config are written
    here (without the quantization_config transformers attaches to GGUF-loaded models)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf), Path(out_dir)
    kw = {"gguf_file": gguf.name}
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    state = {k: v.to(dtype).contiguous() for k, v in hf.state_dict().items()
             if not (tied and k == "lm_head.weight")}  # a tied head: the embedding serves
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    dtype_name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = config["dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(out)
    return hf, tok


__all__ = ["gguf_to_hf_dir"]
