"""`distill-draft`: train a draft for speculative decoding from a target model.

Two kinds, both trained towards the target's next-token distribution on token blocks of text
(train/data.py) and both evaluated on held-out blocks by KL and top-1 agreement
(train/distill_common.py):

- student: the target's architecture with its first N decoder layers (default a quarter, at
  least one), starting from the target's embedding, those layers, its final norm and lm_head,
  trained on KL(p_target || q_student). Saved as a plain HF model with the target's tokenizer:
  the engine loads it as a draft model (method "draft"), transformers as any model.
- head: an EAGLE-1 style head over the target's features (train/head_trainer.py, trained by
  train/head_training.py), loaded by the engine with method "head".

Out: the draft in `out` and distill.json (settings, every evaluation, the outcome).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from llmaccel.errors import LLMAccelError
from llmaccel.train.distill_common import (DistillConfig, DistillResult, Meter, Target,
                                           autocast_for, dtype_name, finish, kl_terms,
                                           load_target, mean_kl_loss, train_loop,
                                           training_blocks)

_LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")


def default_student_layers(target_layers: int) -> int:
    return max(1, target_layers // 4)


def build_student(target_model, num_layers: int):
    """The target's architecture with `num_layers` decoder layers: the target's embedding,
    first `num_layers` layers, final norm and lm_head, copied (fp32, on the target's device).
    """
    import copy

    from transformers import AutoModelForCausalLM

    total = target_model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise LLMAccelError(f"a student needs 1 <= layers < the target's {total} layers, got "
                            f"{num_layers}")
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):  # Qwen2: one entry per layer, checked on init
        config.layer_types = list(config.layer_types[:num_layers])
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, num_layers)
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in target_model.state_dict().items()
             if (m := _LAYER_KEY.search(k)) is None or int(m.group(1)) < num_layers}
    missing, unexpected = student.load_state_dict(state, strict=False)
    # A tied lm_head is not a separate tensor in one of the two state dicts: not missing.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise LLMAccelError(f"cannot build a student from the target: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        student.tie_weights()
    return student.to(target_model.device).eval()


def student_losses(student, target_model, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Mean over every position of KL(target || student) on token blocks [B, T]."""
    with torch.no_grad():
        p_logits = target_model(input_ids=batch).logits
    with autocast_for(batch.device, target_model.dtype):
        q_logits = student(input_ids=batch).logits
    kl = mean_kl_loss(p_logits, q_logits)
    return kl, {"kl": kl.item()}


@torch.no_grad()
def evaluate_student(student, target_model, blocks: torch.Tensor, batch_size: int
                     ) -> dict[str, float]:
    """Held-out means over every position: KL(target || student) and top-1 agreement."""
    student.eval()
    meter = Meter()
    device = next(student.parameters()).device
    for i in range(0, len(blocks), batch_size):
        batch = blocks[i:i + batch_size].to(device)
        with autocast_for(device, target_model.dtype):
            q_logits = student(input_ids=batch).logits
        kl, agree = kl_terms(target_model(input_ids=batch).logits, q_logits)
        meter.add(kl.numel(), kl=kl.sum(), top1=agree.sum())
    m = meter.means()
    return {"heldout_kl": m["kl"], "heldout_top1": m["top1"]}


def train_student(cfg: DistillConfig, target: Target, train: torch.Tensor, held: torch.Tensor,
                  device: torch.device, progress: bool) -> DistillResult:
    """Build, train (early stopping on held-out KL), save the best student in cfg.out."""
    from pathlib import Path

    model = target.model
    total = model.config.num_hidden_layers
    layers = cfg.layers if cfg.layers is not None else default_student_layers(total)
    if total < 2:
        raise LLMAccelError(f"the target has {total} layer: too few to distill a smaller "
                            "student (try --kind head)")
    if layers >= total:
        raise LLMAccelError(f"--layers {layers} must be below the target's {total} layers")
    student = build_student(model, layers)
    if cfg.train_layers_only:
        student.requires_grad_(False)
        student.base_model.layers.requires_grad_(True)
    params = [p for p in student.parameters() if p.requires_grad]
    trained = {n for n, p in student.named_parameters() if p.requires_grad}

    def step_loss(batch: torch.Tensor):
        student.train()
        return student_losses(student, model, batch)

    outcome = train_loop(
        cfg, f"student ({layers} layers)", params, train, device, step_loss,
        lambda: evaluate_student(student, model, held, cfg.batch_size),
        lambda: {n: p.detach().clone() for n, p in student.named_parameters()
                 if n in trained},
        lambda state: _restore(student, state), progress)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    student.to(target.save_dtype)
    student.config.dtype = target.save_dtype
    student.save_pretrained(out, safe_serialization=True)
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(out)
    return finish(cfg, out, outcome, len(train), len(held),
                  {"saved": {"kind": "student", "layers": layers, "target_layers": total,
                             "dtype": dtype_name(target.save_dtype)}})


@torch.no_grad()
def _restore(model, state: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        if n in state:
            p.copy_(state[n])


def distill_draft(cfg: DistillConfig, progress: bool = True,
                  blocks: torch.Tensor | None = None) -> DistillResult:
    """Load the target, cut the training text into blocks, train the draft of `cfg.kind`,
    save it and distill.json in `cfg.out`. `blocks`: [n, seq_len] token ids to use instead of
    tokenizing `cfg.data`."""
    from llmaccel.train.data import load_training_text
    from llmaccel.train.self_data import generate_self_data, parse_self_data

    cfg.check()
    n_self = parse_self_data(cfg.data) if blocks is None else None
    text = load_training_text(cfg.data) if blocks is None and n_self is None else None
    generated = None
    if n_self is not None:  # the target answers first, then is loaded again for training
        generated = generate_self_data(cfg.target, n_self, seed=cfg.seed, dtype=cfg.dtype,
                                       device=cfg.device, progress=progress)
        text = generated.text
    torch.manual_seed(cfg.seed)
    target, device = load_target(cfg)
    train, held = training_blocks(cfg, target.tokenizer, text, blocks)
    if cfg.kind == "student":
        result = train_student(cfg, target, train, held, device, progress)
    else:
        from llmaccel.train.head_training import train_head

        result = train_head(cfg, target, train, held, device, progress)
    if generated is not None:
        # The text beside the draft (`--data` it for another run) and its facts in the record.
        out = Path(cfg.out)
        (out / "self_data.txt").write_text(generated.text, encoding="utf-8")
        summary = json.loads((out / "distill.json").read_text())
        summary["self_data"] = {**generated.facts(), "file": "self_data.txt"}
        (out / "distill.json").write_text(json.dumps(summary, indent=1))
    return result
