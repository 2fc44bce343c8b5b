"""Shared by the NF4 and HQQ end-to-end tests: a tiny random Llama, our engine's greedy tokens
on a quantized checkpoint, and transformers' greedy tokens on the source model with every
decoder linear replaced by what the quantizer says it should dequantize to."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.tiny_models import make_tiny_model

# in_features 128 / 256: group 64 tiles every linear; GQA (2 kv heads): q/k/v shards differ
CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False)
PROMPTS = [[5, 17, 42, 99, 3], [120, 7], list(range(10, 30))]
MAX_TOKENS = 8
DECODER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def make_tiny_llama(directory: Path) -> Path:
    make_tiny_model(LlamaConfig(**CONFIG), directory, seed=0)
    return directory


def cli_quantized_tiny_llama(root: Path, method: str) -> tuple[Path, Path]:
    """(source dir, checkpoint dir): a tiny Llama quantized by `llmaccel quantize --method`
    on the CPU with the method's defaults."""
    from tests.cli_helpers import run_llmaccel

    src = make_tiny_llama(root / "src")
    r = run_llmaccel("quantize", str(src), "--method", method, "--out", str(root / "q"),
                     "--device", "cpu")
    assert r.returncode == 0, r.stderr
    return src, root / "q"


def reference_greedy(src: Path, weight_fn: Callable[[str, torch.Tensor], torch.Tensor]
                     ) -> list[list[int]]:
    """transformers fp32 greedy tokens after W <- weight_fn(name, W) on each decoder linear."""
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the full length, like ignore_eos
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if DECODER_LINEAR.match(name):
                p.copy_(weight_fn(name, p.data))
        outs = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            pad_token_id=0) for p in PROMPTS]
    return [o[0, len(p):].tolist() for o, p in zip(outs, PROMPTS)]


def engine_greedy(checkpoint: Path) -> list[list[int]]:
    from llmaccel import LLM, SamplingParams

    llm = LLM(str(checkpoint), dtype="float32", device="cpu", skip_tokenizer_init=True,
              num_gpu_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]
