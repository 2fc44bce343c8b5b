"""LoRA fine-tuning through peft, with held-out perplexity, early stopping and a merged model.

`finetune` trains low-rank adapters on the attention projections (by default) of an HF model
(a directory, a hub id, or a GGUF file dequantized by transformers) on token blocks of the
training text (train/data.py). Every `eval_every` steps it measures the held-out perplexity
and greedy probe generations. Training stops early when the held-out perplexity has not
improved for `patience` evaluations in a row, when the loss is not finite, or when a probe
that was fine before training turns degenerate (empty or looping output: "degenerate models
with no response" is how fine-tunes fail quietly). The adapters of the best evaluation are
restored either way. Out: `adapter/` (peft's format, loadable with PeftModel), `merged/` (W +
(alpha / r) B A folded into the weights: a plain HF safetensors model that transformers, vLLM
and our engine load) and `finetune.json` (settings, every evaluation, the outcome).

A low learning rate by default (1e-4): LoRA on a small model diverges quickly above ~1e-3.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmaccel.errors import LLMAccelError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class FinetuneConfig:
    model: str
    out: str
    data: str = "wikitext2"
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    lr: float = 1e-4
    steps: int = 200
    batch_size: int = 4
    seq_len: int = 256
    eval_every: int = 25
    heldout: float = 0.1        # the last fraction of the token blocks, never trained on
    patience: int = 2           # evaluations without a new best before stopping
    max_blocks: int | None = None
    probe_prompts: tuple[str, ...] = ("The history of the city", "In mathematics, a prime")
    probe_tokens: int = 24
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"         # auto: bf16 on a GPU, fp32 on the CPU

    def check(self) -> None:
        checks = [(self.lora_r >= 1, f"lora_r must be >= 1, got {self.lora_r}"),
                  (self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}"),
                  (self.lr > 0, f"lr must be > 0, got {self.lr}"),
                  (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
                  (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
                  (self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}"),
                  (self.patience >= 1, f"patience must be >= 1, got {self.patience}"),
                  (bool(self.target_modules), "target_modules must name at least one module")]
        for ok, message in checks:
            if not ok:
                raise LLMAccelError(message)


@dataclass
class FinetuneResult:
    out: Path
    baseline_ppl: float
    best_ppl: float
    best_step: int
    steps_run: int
    stopped: str | None         # why training stopped early, None if it ran every step
    history: list[dict[str, Any]] = field(default_factory=list)


def is_degenerate(ids: list[int]) -> str | None:
    """'empty' or 'looping' for a generation that is, else None. Looping: under half of its
    4-grams distinct (a phrase repeated over and over)."""
    if not ids:
        return "empty"
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    if len(grams) >= 8 and len(set(grams)) < 0.5 * len(grams):
        return "looping"
    return None


@torch.no_grad()
def heldout_nll(model, blocks: torch.Tensor, batch_size: int) -> float:
    """Mean next-token NLL (nats) over every predicted position of the held-out blocks."""
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for i in range(0, len(blocks), batch_size):
        batch = blocks[i:i + batch_size].to(device)
        loss = model(input_ids=batch, labels=batch).loss.float().item()
        n = batch.shape[0] * (batch.shape[1] - 1)
        total, count = total + loss * n, count + n
    return total / count


@torch.no_grad()
def _probe(model, tokenizer, prompts: tuple[str, ...], tokens: int) -> list[list[int]]:
    """Greedy continuations of the probe prompts (token ids), [] without a tokenizer."""
    if tokenizer is None or tokens <= 0:
        return []
    model.eval()
    device = next(model.parameters()).device
    outs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        gen = model.generate(ids, max_new_tokens=tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def finetune(cfg: FinetuneConfig, progress: bool = True,
             blocks: torch.Tensor | None = None) -> FinetuneResult:
    """Train, evaluate, stop early, restore the best adapters, save adapter + merged model.
    `blocks`: [n, seq_len] token ids to use instead of tokenizing `cfg.data`."""
    from peft import LoraConfig, get_peft_model

    from llmaccel.train.data import load_training_text, split_heldout, token_blocks
    from llmaccel.train.loop import load_causal_lm, resolve_device_dtype, train_with_early_stop

    cfg.check()
    device, dtype = resolve_device_dtype(cfg.device, cfg.dtype)
    text = load_training_text(cfg.data) if blocks is None else None  # bad data fails first
    torch.manual_seed(cfg.seed)
    base, tokenizer = load_causal_lm(cfg.model, device, dtype)
    if blocks is None:
        if tokenizer is None:
            raise LLMAccelError(f"no tokenizer found for {cfg.model!r}: cannot tokenize the "
                                "training text")
        blocks = token_blocks(tokenizer, text, cfg.seq_len, cfg.max_blocks)
    train, held = split_heldout(blocks, cfg.heldout)
    names = {n.rsplit(".", 1)[-1] for n, _ in base.named_modules()}
    missing = [m for m in cfg.target_modules if m not in names]
    if missing:
        raise LLMAccelError(f"target module(s) {', '.join(missing)} not in {cfg.model!r}")
    model = get_peft_model(base, LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.target_modules), task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    trained = {n for n, p in model.named_parameters() if p.requires_grad}

    def step_loss(batch: torch.Tensor) -> torch.Tensor:
        model.train()
        return model(input_ids=batch, labels=batch).loss

    def evaluate() -> dict[str, Any]:
        nll = heldout_nll(model, held, cfg.batch_size)
        probes = _probe(model, tokenizer, cfg.probe_prompts, cfg.probe_tokens)
        return {"heldout_nll": nll, "heldout_ppl": math.exp(nll),
                "probes": [tokenizer.decode(p) for p in probes] if probes else [],
                "degenerate": [is_degenerate(p) for p in probes]}

    def probes_turned(row: dict[str, Any], first: dict[str, Any]) -> str | None:
        """A probe that was fine before training and is empty or looping now."""
        turned = [d for d, before in zip(row["degenerate"], first["degenerate"])
                  if d and before is None]
        return f"probe generations turned {turned[0]} at step {row['step']}" if turned else None

    @torch.no_grad()
    def restore(state: dict[str, torch.Tensor]) -> None:
        for n, p in model.named_parameters():
            if n in state:
                p.copy_(state[n])

    outcome = train_with_early_stop(
        params=params, lr=cfg.lr, steps=cfg.steps, batch_size=cfg.batch_size,
        eval_every=cfg.eval_every, patience=cfg.patience, seed=cfg.seed, train=train,
        device=device, step_loss=step_loss, evaluate=evaluate, metric="heldout_nll",
        metric_name="perplexity", describe=lambda nll: f"{math.exp(nll):.3f}",
        snapshot=lambda: {n: p.detach().clone() for n, p in model.named_parameters()
                          if n in trained},
        restore=restore, label="LoRA",
        status=lambda row: f"held-out ppl {row['heldout_ppl']:.3f}", check=probes_turned,
        progress=progress)
    history, best_step, step = outcome.history, outcome.best_step, outcome.steps_run
    best = next(h for h in history if h["step"] == best_step)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].base_model_name_or_path = cfg.model  # what the user named
    model.save_pretrained(out / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(out / "merged", safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out / "merged")
    result = FinetuneResult(out, history[0]["heldout_ppl"], best["heldout_ppl"], best_step,
                            step, outcome.stopped, history)
    summary = {"config": {k: list(v) if isinstance(v, tuple) else v
                          for k, v in asdict(cfg).items()},
               "train_blocks": len(train), "heldout_blocks": len(held),
               "baseline_ppl": result.baseline_ppl, "best_ppl": result.best_ppl,
               "best_step": best_step, "steps_run": step, "stopped": outcome.stopped,
               "history": history}
    (out / "finetune.json").write_text(json.dumps(summary, indent=1))
    return result
