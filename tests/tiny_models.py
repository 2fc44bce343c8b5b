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


def make_tiny_head(target: PretrainedConfig, directory: Path, seed: int = 0,
                   fc_bias: bool = False) -> dict[str, torch.Tensor]:
    """A random EAGLE-style draft head for `target` in the layout `llmaccel distill-draft
    --kind head` writes (models/eagle_head.py): a one-layer Llama config with our marker,
    fc and layer 0 without input_layernorm. Returns the tensors."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter = target.hidden_size, target.intermediate_size
    heads, kv = target.num_attention_heads, target.num_key_value_heads
    hd = getattr(target, "head_dim", None) or h // heads

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    tensors = {"fc.weight": rand(h, 2 * h),
               "layers.0.self_attn.q_proj.weight": rand(heads * hd, h),
               "layers.0.self_attn.k_proj.weight": rand(kv * hd, h),
               "layers.0.self_attn.v_proj.weight": rand(kv * hd, h),
               "layers.0.self_attn.o_proj.weight": rand(h, heads * hd),
               "layers.0.mlp.gate_proj.weight": rand(inter, h),
               "layers.0.mlp.up_proj.weight": rand(inter, h),
               "layers.0.mlp.down_proj.weight": rand(h, inter),
               "layers.0.post_attention_layernorm.weight": 1.0 + rand(h, scale=0.1)}
    if fc_bias:
        tensors["fc.bias"] = rand(h)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    cfg = LlamaConfig(vocab_size=target.vocab_size, hidden_size=h, intermediate_size=inter,
                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=hd, max_position_embeddings=target.max_position_embeddings,
                      rms_norm_eps=target.rms_norm_eps, tie_word_embeddings=False).to_dict()
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        if getattr(target, key, None) is not None:
            cfg[key] = getattr(target, key)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["llmaccel_draft_head"] = {"kind": "eagle", "target": "tiny", "feature":
                                  "final_norm_output", "fc_bias": fc_bias}
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return tensors


def make_echo_head_pair(directory: Path):
    """A tiny qwen2 target whose LM head is its embedding matrix (its greedy output mostly
    repeats the last token) in directory/target, and a head in directory/head whose output is
    mostly its input feature (fc passes the feature half through; the layer's output
    projections scaled down), so it mostly drafts the last token again: rounds accept all k
    drafts, some, or none (a random head accepts nothing). Returns (the transformers target,
    the head's tensors)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    cfg = tiny_configs()["qwen2"]
    hf = make_tiny_model(cfg, directory / "target", seed=1)
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight)
    hf.save_pretrained(directory / "target")
    tensors = make_tiny_head(cfg, directory / "head", seed=5, fc_bias=True)
    h = cfg.hidden_size
    fc = tensors["fc.weight"] * 0.05
    fc[:, h:] += torch.eye(h)
    tensors["fc.weight"], tensors["fc.bias"] = fc, tensors["fc.bias"] * 0.05
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        tensors[name] = tensors[name] * 0.4
    save_file(tensors, str(directory / "head" / "model.safetensors"))
    return hf, tensors


def periodic_blocks(n: int = 40, seq_len: int = 32, period: int = 7, seed: int = 0
                    ) -> torch.Tensor:
    """[n, seq_len] token blocks of one periodic sequence (random phase per block): learnable
    in a few steps, so a working training loop must lower its held-out loss."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 150, (period,), generator=g)
    rows = []
    for _ in range(n):
        phase = int(torch.randint(period, (1,), generator=g))
        rows.append(motif.roll(phase).repeat(seq_len // period + 1)[:seq_len])
    return torch.stack(rows)


def save_word_tokenizer(words: list[str], directory: Path, eos: str = "</s>") -> int:
    """A word-level HF tokenizer (<unk>, `eos`, then `words` in order; split on whitespace,
    decoded with spaces) saved to `directory`: text prompts and stop strings on tiny models.
    Returns its size (the model's vocab_size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, eos: 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token=eos).save_pretrained(directory)
    return len(vocab)

