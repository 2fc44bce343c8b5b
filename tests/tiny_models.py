"""Tiny random HF models of each supported family, saved as safetensors directories."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig,
                          Qwen2Config)

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def tiny_configs() -> dict[str, PretrainedConfig]:
    return {
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=False),
        "llama-tied": LlamaConfig(**COMMON, tie_word_embeddings=True),
        "llama3-rope": LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=False, rms_norm_eps=1e-6),
        # explicit head_dim that differs from hidden / heads
        "mistral": MistralConfig(**COMMON, head_dim=24, sliding_window=None),
    }


def make_tiny_model(config: PretrainedConfig, directory: Path, seed: int = 0):
    """An HF model with every parameter random (biases and norm weights too, which HF
    initializes to constants), saved to `directory`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    return model
