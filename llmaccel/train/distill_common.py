"""What both kinds of draft distillation share: the settings, the frozen target, token blocks,
the KL / agreement measures and the training loop with held-out early stopping.

A draft is only as good as how often the target accepts its tokens, so both kinds train
towards the target's next-token distribution (KL(p_target || q_draft), temperature 1) and
report, per evaluation on held-out blocks, the mean KL over positions and the top-1 agreement
(the draft's argmax equals the target's: the step-1 acceptance of greedy speculation). The
best evaluation by held-out KL is kept, as `finetune` keeps its best perplexity.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmaccel.errors import LLMAccelError
from llmaccel.train.loop import LoopOutcome, train_with_early_stop

KINDS = ("student", "head")
# Per kind: a whole (small) model moves far with 1e-3; one fresh-ish layer needs more room.
DEFAULT_LR = {"student": 1e-4, "head": 5e-4}


@dataclass
class DistillConfig:
    target: str
    out: str
    kind: str = "head"
    data: str = "wikitext2"
    layers: int | None = None       # student: decoder layers kept (default: a quarter, >= 1)
    train_layers_only: bool = False  # student: freeze the embedding, final norm and lm_head
    lr: float | None = None         # None: DEFAULT_LR of the kind
    steps: int = 200
    batch_size: int = 4
    seq_len: int = 256
    eval_every: int = 25
    heldout: float = 0.1            # the last fraction of the token blocks, never trained on
    # ... but at most this many blocks (None: no cap). A large text's tenth is more than an
    # estimate needs: 3,106 blocks (1.6M tokens) were scored in ~70 s at the end
    # of a ~600 s device call, and none of it trained on.
    max_heldout_blocks: int | None = None
    patience: int = 2               # evaluations without a new best before stopping
    max_blocks: int | None = None
    # blocks start at records, each beginning with this string (train/data.record_blocks;
    # None: the text as one stream)
    record_start: str | None = None
    kl_weight: float = 0.1          # head: KL term beside the feature regression (EAGLE's 0.1)
    feature_noise: float = 0.1      # head: uniform input-feature noise, relative to their RMS
    # head: drafting steps trained on the head's own outputs (EAGLE-3's training-time test;
    # 1 = EAGLE-1, the target's features only)
    unroll_steps: int = 1
    unroll_decay: float = 1.0       # head: weight of draft step j's loss is unroll_decay**(j-1)
    init_head: str | None = None    # head: start from this saved head, not the target's layer
    unroll_detach: bool = False     # head: no gradient through the outputs fed back as features
    fc_bias: bool = False           # head: vLLM's EAGLE-1 llama loader has no fc bias
    # head: the target's features of every block computed once and kept on the device
    # (train/feature_cache.py), not once per step
    cache_features: bool = False
    # head: EAGLE-3's multi-layer features. Besides the final hidden state, the hidden state
    # entering each of these target layers (vLLM's eagle_aux_hidden_state_layer_ids
    # convention), normalized by that layer's input norm, fused into the head's feature
    # width by a linear `fuse` (() = EAGLE-1: the final hidden state only)
    aux_layers: tuple[int, ...] = ()
    # head: fc also reads the embedding of the token at each feature's own position, so its
    # one layer can do the induction lookup copying needs (train/head_trainer.py)
    prev_token: bool = False
    # head: the scale that part of fc starts at (train/head_init.init_prev_token_part)
    prev_token_init: float = 0.1
    # head: q/k of its layer copied from the target's last layer ("target") or drawn afresh
    # ("random", as EAGLE's layer starts: train/head_init.init_attention_scores)
    attention_init: str = "target"
    # head: weight of the copy-attention loss (train/head_metrics.copy_attention_loss): the
    # layer's first `copy_attention_heads` query heads taught to attend to the n-gram lookup's
    # source at copy positions (0: off), against the attention's collapse onto a sink
    copy_attention_weight: float = 0.0
    copy_attention_heads: int = 2
    # head: the taught heads one per key/value group in turn (their own keys and values),
    # not the first ones (which share one group's)
    copy_attention_spread: bool = False
    # head: with unroll_steps > 1, the copy-attention loss at every unrolled draft step (where
    # the query row is built from the head's own output), not only at step 1
    # (train/head_metrics.unrolled_copy_attention_loss)
    copy_attention_all_steps: bool = False
    # head: the draft vocabulary saved beside it (draft_vocab.json): the training text's most
    # frequent target tokens, the only ones its LM head scores when drafting (0: none, the
    # whole vocabulary); FR-Spec / EAGLE-3 cut the draft's LM-head cost this way.
    draft_vocab_size: int = 32768
    # head: the KL over the draft vocabulary only ("draft", EAGLE-3's way: all the engine's
    # head scores; most of a step's LM-head work saved) or the whole one ("full")
    loss_vocab: str = "draft"
    # held-out blocks scored at each evaluation during training (the first N; None: all);
    # with fewer, the best weights are scored on all of them at the end (final_heldout)
    eval_blocks: int | None = None
    schedule: str = "cosine"        # learning rate: cosine (down to a tenth) or constant
    warmup: int | None = None       # linear warm-up steps (None: a tenth of steps, <= 100)
    max_seconds: float | None = None  # stop (evaluate, keep the best) after this long
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"             # the target's: auto = bf16 on a GPU, fp32 on the CPU

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.kind]

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(100, self.steps // 10)

    def check(self) -> None:
        checks = [(self.kind in KINDS,
                   f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}"),
                  (self.layers is None or self.layers >= 1,
                   f"layers must be >= 1, got {self.layers}"),
                  (self.layers is None or self.kind == "student",
                   "layers sets the size of a student (kind 'student'); a head has one"),
                  (self.lr is None or self.lr > 0, f"lr must be > 0, got {self.lr}"),
                  (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
                  (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
                  (self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}"),
                  (self.patience >= 1, f"patience must be >= 1, got {self.patience}"),
                  (self.kl_weight >= 0, f"kl_weight must be >= 0, got {self.kl_weight}"),
                  (self.feature_noise >= 0,
                   f"feature_noise must be >= 0, got {self.feature_noise}"),
                  (1 <= self.unroll_steps <= 8,
                   f"unroll_steps must be 1-8, got {self.unroll_steps}"),
                  (self.unroll_steps == 1 or self.kind == "head",
                   "unroll_steps trains a head (kind 'head') on its own drafts"),
                  (0 < self.unroll_decay <= 1,
                   f"unroll_decay must be in (0, 1], got {self.unroll_decay}"),
                  (self.init_head is None or self.kind == "head",
                   "init_head starts a head (kind 'head') from a saved one"),
                  (not self.cache_features or self.kind == "head",
                   "cache_features keeps the target's features for a head (kind 'head'); a "
                   "student trains on the target's logits"),
                  (not self.aux_layers or self.kind == "head",
                   "aux_layers gives a head (kind 'head') the target's earlier layers"),
                  (all(isinstance(i, int) and i >= 1 for i in self.aux_layers)
                   and len(set(self.aux_layers)) == len(self.aux_layers),
                   f"aux_layers must be distinct layer indexes >= 1, got {self.aux_layers}"),
                  (not self.prev_token or self.kind == "head",
                   "prev_token gives a head (kind 'head') the token at its feature's position"),
                  (self.attention_init in ("target", "random"),
                   f"attention_init must be target or random, got {self.attention_init!r}"),
                  (self.attention_init == "target" or self.kind == "head",
                   "attention_init starts a head's (kind 'head') attention"),
                  (self.copy_attention_weight >= 0,
                   f"copy_attention_weight must be >= 0, got {self.copy_attention_weight}"),
                  (self.copy_attention_heads >= 1,
                   f"copy_attention_heads must be >= 1, got {self.copy_attention_heads}"),
                  (self.prev_token_init >= 0,
                   f"prev_token_init must be >= 0, got {self.prev_token_init}"),
                  (self.draft_vocab_size >= 0,
                   f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}"),
                  (self.loss_vocab in ("draft", "full"),
                   f"loss_vocab must be draft or full, got {self.loss_vocab!r}"),
                  (self.max_heldout_blocks is None or self.max_heldout_blocks >= 1,
                   f"max_heldout_blocks must be >= 1, got {self.max_heldout_blocks}"),
                  (self.eval_blocks is None or self.eval_blocks >= 1,
                   f"eval_blocks must be >= 1, got {self.eval_blocks}"),
                  (self.eval_blocks is None or self.kind == "head",
                   "eval_blocks scores a head (kind 'head') on fewer held-out blocks"),
                  (self.schedule in ("cosine", "constant"),
                   f"schedule must be cosine or constant, got {self.schedule!r}"),
                  (self.warmup is None or self.warmup >= 0,
                   f"warmup must be >= 0, got {self.warmup}"),
                  (self.max_seconds is None or self.max_seconds > 0,
                   f"max_seconds must be > 0, got {self.max_seconds}")]
        for ok, message in checks:
            if not ok:
                raise LLMAccelError(message)


@dataclass
class DistillResult:
    out: Path
    kind: str
    baseline_kl: float
    best_kl: float
    baseline_top1: float
    best_top1: float
    best_step: int
    steps_run: int
    stopped: str | None             # why training stopped early, None if it ran every step
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Target:
    """The frozen target: model, tokenizer (None without tokenizer files), its config as a
    dict (config.json as written where there is one, so rope settings copy exactly) and the
    dtype to save drafts in (the checkpoint's, not the one trained in)."""
    model: Any
    tokenizer: Any
    config: dict[str, Any]
    save_dtype: torch.dtype


def load_target(cfg: DistillConfig) -> tuple[Target, torch.device]:
    """Load the target (HF directory, hub id or GGUF), frozen."""
    from llmaccel.models.source import resolve_model_source
    from llmaccel.train.loop import DTYPES, load_causal_lm, resolve_device_dtype

    device, dtype = resolve_device_dtype(cfg.device, cfg.dtype)
    model, tokenizer = load_causal_lm(cfg.target, device, dtype)
    model.eval().requires_grad_(False)
    source = resolve_model_source(cfg.target)
    raw = None
    if source.kind == "hf" and source.path is not None:
        path = Path(source.path) / "config.json"
        raw = json.loads(path.read_text()) if path.is_file() else None
    config = raw if raw is not None else model.config.to_dict()
    stored = str(config.get("dtype") or config.get("torch_dtype") or "")
    save_dtype = DTYPES.get(stored.removeprefix("torch."), dtype)
    return Target(model, tokenizer, config, save_dtype), device


def autocast_for(device: torch.device, dtype: torch.dtype):
    """Mixed precision for an fp32 draft on a GPU whose target runs in 16-bit (the CPU runs
    in fp32 as is: the reference)."""
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return nullcontext()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def training_blocks(cfg: DistillConfig, tokenizer, text: str | None,
                    blocks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held out) token blocks of `text`, or of `blocks` when given."""
    from llmaccel.train.data import record_blocks, split_heldout, token_blocks

    if blocks is None:
        assert text is not None
        if tokenizer is None:
            raise LLMAccelError(f"no tokenizer found for {cfg.target!r}: cannot tokenize the "
                                "training text")
        if cfg.record_start:
            blocks = record_blocks(tokenizer, text, cfg.seq_len, cfg.record_start,
                                   cfg.max_blocks)
        else:
            blocks = token_blocks(tokenizer, text, cfg.seq_len, cfg.max_blocks)
    return split_heldout(blocks, cfg.heldout, cfg.max_heldout_blocks)


def kl_terms(p_logits: torch.Tensor, q_logits: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(p || q) (nats) and whether argmax q == argmax p, for logits [..., V].
    In fp32: bf16 log-probabilities are too coarse for a KL near zero."""
    logp = F.log_softmax(p_logits.float(), dim=-1)
    logq = F.log_softmax(q_logits.float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    agree = p_logits.argmax(-1) == q_logits.argmax(-1)
    return kl, agree


def mean_kl_loss(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q), differentiable in q; p carries no gradient."""
    v = q_logits.shape[-1]
    logp = F.log_softmax(p_logits.detach().float().reshape(-1, v), dim=-1)
    logq = F.log_softmax(q_logits.float().reshape(-1, v), dim=-1)
    return F.kl_div(logq, logp, log_target=True, reduction="batchmean")


class Meter:
    """Sums of per-position measures over held-out batches -> their means."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, n: int, **sums: float) -> None:
        self.count += n
        for k, v in sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def means(self) -> dict[str, float]:
        return {k: v / max(self.count, 1) for k, v in self.sums.items()}


def train_loop(cfg: DistillConfig, label: str, params: list[torch.nn.Parameter],
               train: torch.Tensor, device: torch.device,
               step_loss: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
               evaluate: Callable[[], dict[str, float]],
               snapshot: Callable[[], Any], restore: Callable[[Any], None],
               progress: bool) -> LoopOutcome:
    """train/loop.py's loop with the distillation settings: early stop on the held-out KL
    (`evaluate` returns heldout_kl and heldout_top1)."""
    return train_with_early_stop(
        params=params, lr=cfg.learning_rate, steps=cfg.steps, batch_size=cfg.batch_size,
        eval_every=cfg.eval_every, patience=cfg.patience, seed=cfg.seed, train=train,
        device=device, step_loss=lambda batch: step_loss(batch)[0], evaluate=evaluate,
        metric="heldout_kl", metric_name="KL", describe=lambda kl: f"{kl:.4f}",
        snapshot=snapshot, restore=restore, label=label,
        status=lambda row: (f"held-out KL {row['heldout_kl']:.3f} "
                            f"top-1 {row['heldout_top1']:.1%}"),
        progress=progress, schedule=cfg.schedule, warmup=cfg.warmup_steps,
        max_seconds=cfg.max_seconds)


def finish(cfg: DistillConfig, out: Path, outcome: LoopOutcome, n_train: int, n_held: int,
           extra: dict[str, Any]) -> DistillResult:
    """The result, and distill.json (settings, every evaluation, the outcome) in `out`."""
    first = outcome.history[0]
    best = next(h for h in outcome.history if h["step"] == outcome.best_step)
    result = DistillResult(out, cfg.kind, first["heldout_kl"], best["heldout_kl"],
                           first["heldout_top1"], best["heldout_top1"], outcome.best_step,
                           outcome.steps_run, outcome.stopped, outcome.history)
    summary = {"kind": cfg.kind, "target": cfg.target, "config": asdict(cfg),
               "lr": cfg.learning_rate, "train_blocks": n_train, "heldout_blocks": n_held,
               **extra, "baseline_kl": result.baseline_kl, "best_kl": result.best_kl,
               "baseline_top1": result.baseline_top1, "best_top1": result.best_top1,
               "best_step": outcome.best_step, "steps_run": outcome.steps_run,
               "stopped": outcome.stopped, "history": outcome.history}
    (out / "distill.json").write_text(json.dumps(summary, indent=1))
    return result
