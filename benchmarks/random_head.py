"""A random draft head for a target (a benchmark shape or an HF directory), in the layout
`llmaccel distill-draft --kind head` writes, with a draft vocabulary of the first N token ids:
what a head round costs on the GPU, without training one (its drafts are rejected).

    python benchmarks/random_head.py qwen2.5-1.5b /tmp/rhead --vocab 32768
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def make_random_head(target: str, out: str | Path, vocab: int = 32768, seed: int = 0) -> str:
    from safetensors.torch import save_file

    from llmaccel.models.draft_head import DRAFT_VOCAB_FILE
    from llmaccel.models.shapes import SHAPES
    from llmaccel.train.draft_head import LAYER_TENSORS, head_config_dict

    if target in SHAPES:
        config = dict(SHAPES[target])
    else:
        config = json.loads((Path(target) / "config.json").read_text())
    head = head_config_dict(config, target, torch.bfloat16)
    h, inter = head["hidden_size"], head["intermediate_size"]
    q, kv = head["num_attention_heads"] * head["head_dim"], (
        head["num_key_value_heads"] * head["head_dim"])
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter), "post_attention_layernorm.weight": (h,)}
    assert set(shapes) == set(LAYER_TENSORS)
    g = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": torch.randn(h, 2 * h, generator=g) * 0.02}
    for name, shape in shapes.items():
        tensors[f"layers.0.{name}"] = (torch.ones(shape) if len(shape) == 1
                                       else torch.randn(*shape, generator=g) * 0.02)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(head, indent=1))
    if vocab:
        ids = list(range(min(vocab, head["vocab_size"])))
        (out / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": ids}))
    return str(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args()
    print(make_random_head(a.target, a.out, a.vocab))
