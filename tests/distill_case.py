"""What the distillation tests share (test_train_distill.py, test_head_training.py): their
settings, the tiny target they train drafts for, and a head's drafted outputs computed row
by row."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import make_tiny_model, tiny_configs

from llmaccel.train.distill_common import DistillConfig

H, V = 64, 160  # tiny_models' hidden size and vocabulary


def distill_cfg(target, out, **kw) -> DistillConfig:
    base = dict(target=str(target), out=str(out), steps=30, batch_size=4, eval_every=10,
                heldout=0.2, patience=5, device="cpu")
    return DistillConfig(**{**base, **kw})


def make_distill_target(directory: Path) -> Path:
    """The tiny llama every distillation test trains for."""
    make_tiny_model(tiny_configs()["llama"], directory, seed=2)
    return directory


def tiny_head_pair(tmp_path: Path):
    """The tiny target (HF, fp32) and a fresh prev-token head for it, its q/k drawn afresh."""
    from llmaccel.train.head_trainer import build_draft_head

    target = hf_target(make_distill_target(tmp_path / "t"))
    torch.manual_seed(0)
    return target, build_draft_head(target, prev_token=True, attention_init="random")


def copy_blocks(g: torch.Generator, n: int) -> torch.Tensor:
    """n blocks of random tokens with copies: a random 12-token stretch, 8 others, the
    stretch again and the first 4 others again."""
    out = []
    for _ in range(n):
        a = torch.randint(3, 150, (12,), generator=g)
        b = torch.randint(3, 150, (8,), generator=g)
        out.append(torch.cat([a, b, a, b[:4]]))
    return torch.stack(out)


def hf_target(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def drafted_outputs(head, ids: torch.Tensor, feats: torch.Tensor, t: int, steps: int
                    ) -> list[torch.Tensor]:
    """The head's outputs for its drafts 1..steps after the context x_0..x_{t+1} of one
    sequence, drafts 1..s-1 being the true next tokens: the head's forward over the context
    rows, then one row (x_{t+s}, its own previous output) appended per draft, as the engine
    drafts (test_train_distill's _head_drafts)."""
    row_ids, row_feats, outs = list(ids[1:t + 2]), list(feats[:t + 1]), []
    for s in range(1, steps + 1):
        o = head(torch.stack(row_ids)[None], torch.stack(row_feats)[None])[0, -1]
        outs.append(o)
        row_ids.append(ids[min(t + s + 1, len(ids) - 1)])
        row_feats.append(o)
    return outs
