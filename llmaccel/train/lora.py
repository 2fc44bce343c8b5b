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
import time
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


def _load(cfg: FinetuneConfig, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmaccel.models.source import resolve_model_source

    source = resolve_model_source(cfg.model)
    if source.kind == "shape":
        raise LLMAccelError(f"{cfg.model!r} is a benchmark shape with random weights; "
                            "fine-tuning needs a real model (HF directory, hub id or GGUF)")
    if source.kind == "gguf":
        # transformers marks a GGUF-loaded model as quantized and refuses to save it (the
        # merged model): train on the dequantized weights as a plain HF directory instead.
        import shutil
        import tempfile

        from llmaccel.models.convert import gguf_to_hf_dir

        tmp = tempfile.mkdtemp(prefix="llmaccel-lora-base-")
        try:
            _, tokenizer = gguf_to_hf_dir(source.path, tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return model, tokenizer
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path)
    except Exception:  # no tokenizer files: fine when token blocks are passed in
        tokenizer = None
    if tokenizer is not None and len(tokenizer) == 0:
        tokenizer = None  # transformers 5 builds an empty one for a directory without files
    return model, tokenizer


def _resolve(cfg: FinetuneConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if cfg.dtype not in names:
        raise LLMAccelError(f"dtype must be one of {', '.join(names)}, got {cfg.dtype!r}")
    return device, names[cfg.dtype]


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
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from llmaccel.train.data import load_training_text, split_heldout, token_blocks

    cfg.check()
    device, dtype = _resolve(cfg)
    text = load_training_text(cfg.data) if blocks is None else None  # bad data fails first
    torch.manual_seed(cfg.seed)
    base, tokenizer = _load(cfg, device, dtype)
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
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def evaluate(step: int, train_loss: float | None) -> dict[str, Any]:
        nll = heldout_nll(model, held, cfg.batch_size)
        probes = _probe(model, tokenizer, cfg.probe_prompts, cfg.probe_tokens)
        row = {"step": step, "train_loss": train_loss, "heldout_nll": nll,
               "heldout_ppl": math.exp(nll), "seconds": round(time.perf_counter() - t0, 2),
               "probes": [tokenizer.decode(p) for p in probes] if probes else [],
               "degenerate": [is_degenerate(p) for p in probes]}
        history.append(row)
        return row

    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    first = evaluate(0, None)
    fine_before = [d is None for d in first["degenerate"]]
    best_nll, best_step, best_state = first["heldout_nll"], 0, snapshot()
    stopped, bad, losses, step = None, 0, [], 0
    bar = Progress(TextColumn("LoRA"), BarColumn(), TextColumn(
        "{task.completed}/{task.total} loss {task.fields[loss]:.3f} held-out ppl "
        "{task.fields[ppl]:.3f}"), TimeRemainingColumn(), disable=not progress)
    task = bar.add_task("train", total=cfg.steps, loss=float("nan"), ppl=math.exp(best_nll))
    bar.start()
    for step in range(1, cfg.steps + 1):
        model.train()
        idx = torch.randint(len(train), (cfg.batch_size,), generator=gen)
        batch = train[idx].to(device)
        loss = model(input_ids=batch, labels=batch).loss
        if not torch.isfinite(loss):
            stopped = f"the training loss is not finite at step {step}"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(task, completed=step, loss=losses[-1])
        if step % cfg.eval_every and step != cfg.steps:
            continue
        row = evaluate(step, sum(losses) / len(losses))
        losses = []
        bar.update(task, loss=row["train_loss"], ppl=row["heldout_ppl"])
        turned = [d for d, ok in zip(row["degenerate"], fine_before) if d and ok]
        if row["heldout_nll"] < best_nll:
            best_nll, best_step, best_state, bad = row["heldout_nll"], step, snapshot(), 0
        else:
            bad += 1
        if turned:
            stopped = f"probe generations turned {turned[0]} at step {step}"
        elif bad >= cfg.patience:
            stopped = (f"held-out perplexity did not improve for {bad} evaluations "
                       f"(best {math.exp(best_nll):.3f} at step {best_step})")
        if stopped:
            break
    bar.stop()
    with torch.no_grad():  # the best evaluation's adapters (maybe the untrained ones)
        for n, p in model.named_parameters():
            if n in best_state:
                p.copy_(best_state[n])
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].base_model_name_or_path = cfg.model  # what the user named
    model.save_pretrained(out / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(out / "merged", safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out / "merged")
    result = FinetuneResult(out, math.exp(first["heldout_nll"]), math.exp(best_nll), best_step,
                            step, stopped, history)
    summary = {"config": {k: list(v) if isinstance(v, tuple) else v
                          for k, v in asdict(cfg).items()},
               "train_blocks": len(train), "heldout_blocks": len(held),
               "baseline_ppl": result.baseline_ppl, "best_ppl": result.best_ppl,
               "best_step": best_step, "steps_run": step, "stopped": stopped,
               "history": history}
    (out / "finetune.json").write_text(json.dumps(summary, indent=1))
    return result
