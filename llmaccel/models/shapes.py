"""Named benchmark shapes (docs/workloads.md) as HF config dicts, for `load_format="dummy"`.

The values mirror the public config.json of each model so that a dummy model has the same
parameter count, KV-cache size and rope setup as the real one.
"""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE_32 = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}
_LLAMA3_ROPE_8 = dict(_LLAMA3_ROPE_32, factor=8.0)


def _llama3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool,
            rope: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hidden // heads,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": dict(rope), "tie_word_embeddings": tied,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


def _qwen2(hidden: int, inter: int, layers: int, heads: int) -> dict[str, Any]:
    """Qwen2.5-0.5B / -1.5B: 2 KV heads, a 151936-token vocabulary, tied head, qkv bias."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, True, _LLAMA3_ROPE_32),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 8, True, _LLAMA3_ROPE_32),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 8, False, _LLAMA3_ROPE_8),
    # Qwen2.5-1.5B's config.json ties the head; its GGUF stores a separate output.weight.
    "qwen2.5-1.5b": _qwen2(1536, 8960, 28, 12),
    # Qwen2.5-0.5B (and -Coder-0.5B): the draft of the W5 pair.
    "qwen2.5-0.5b": _qwen2(896, 4864, 24, 14),
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "bfloat16",
    },
}


def shape_names() -> list[str]:
    return sorted(SHAPES)
