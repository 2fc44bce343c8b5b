"""`llmaccel distill-draft`: a draft student or an EAGLE-style head trained towards the
target's next-token distribution (train/distill.py). Registered in cli.py with
`app.command("distill-draft")(distill_draft)`; torch and the trainers are imported only when
the command runs."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

from llmaccel.cli import options as o

console = Console()


def distill_draft(
    target: Optional[str] = typer.Argument(None, help="The target: an HF directory, a hub id "
                                           "(org/name) or a GGUF file (dequantized by "
                                           "transformers); default: the default model."),
    kind: str = typer.Option("head", help="student (the target's first --layers layers, "
                             "trained on its distribution; engine method \"draft\") or head "
                             "(an EAGLE-style layer over the target's features; method "
                             "\"head\")."),
    data: str = typer.Option("wikitext2", help="wikitext2 (its validation split: found in "
                             "$LLMACCEL_DATA_DIR, ../shared/data or the user cache, else "
                             "downloaded once), a text file, a WikiText-2 directory, a Hugging "
                             "Face dataset id, or self[:N]: the target's own answers to N code and prose requests "
                             "(default 1024), generated first (self-distillation)."),
    layers: Optional[int] = typer.Option(None, min=1, help="student: decoder layers to keep "
                                         "(default: a quarter of the target's, at least 1)."),
    lr: Optional[float] = typer.Option(None, help="Learning rate (default: 1e-4 for a "
                                       "student, 5e-4 for a head)."),
    steps: int = typer.Option(200, min=1, help="Optimizer steps."),
    batch_size: int = typer.Option(4, min=1),
    seq_len: int = typer.Option(256, min=2, help="Tokens per training block."),
    eval_every: int = typer.Option(25, min=1, help="Steps between held-out evaluations."),
    patience: int = typer.Option(2, min=1, help="Evaluations without a new best held-out KL "
                                 "before stopping."),
    max_blocks: Optional[int] = typer.Option(None, min=2, help="Use at most this many blocks "
                                             "of the data."),
    record_start: Optional[str] = typer.Option(None, help="Start every block at a record: "
                                               "the text splits before each occurrence of "
                                               "this string, e.g. '<|im_start|>system' (so "
                                               "an answer's prompt stays in its block)."),
    kl_weight: float = typer.Option(0.1, min=0.0, help="head: weight of the KL term beside "
                                    "the feature regression."),
    feature_noise: float = typer.Option(0.1, min=0.0, help="head: uniform noise on the input "
                                        "features, relative to their RMS (0: off)."),
    unroll_steps: int = typer.Option(1, min=1, max=8, help="head: also train it to draft this "
                                     "many tokens ahead on its own outputs (EAGLE-3's "
                                     "training-time test; 1: the target's features only)."),
    unroll_decay: float = typer.Option(1.0, min=0.0, max=1.0, help="head: weight of draft "
                                       "step j's loss is this to the power j - 1."),
    unroll_detach: bool = typer.Option(False, help="head: with --unroll-steps, no gradient "
                                       "through the drafts fed back as features"),
    init_head: Optional[str] = typer.Option(None, help="head: start from this saved head "
                                            "(e.g. to go on with --unroll-steps)."),
    cache_features: bool = typer.Option(False, help="head: compute the target's features of "
                                        "every block once and keep them on the device, "
                                        "instead of running the target every step (needs "
                                        "blocks x seq_len x hidden size in the target's "
                                        "dtype; an error if that does not fit)."),
    aux_layers: str = typer.Option("", help="head: EAGLE-3's multi-layer features, e.g. "
                                   "2,14: besides the final hidden state, the hidden states "
                                   "entering these target layers (normalized by their input "
                                   "norms) are fused into the head's input (empty: EAGLE-1)."),
    prev_token: bool = typer.Option(False, help="head: fc also reads the embedding of the "
                                    "token at each feature's position, so the one layer can "
                                    "look up where a token occurred before (copying)."),
    prev_token_init: float = typer.Option(0.1, min=0.0, help="head: with --prev-token, the "
                                          "scale its part of fc starts at (relative to the "
                                          "features; the next token's part: 0.71)."),
    attention_init: str = typer.Option("target", help="head: its layer's q/k copied from the "
                                       "target's last layer (target) or drawn afresh "
                                       "(random, as EAGLE's layer starts)."),
    copy_attention_weight: float = typer.Option(0.0, min=0.0, help="head: weight of a loss "
                                                "teaching some of its attention heads to look "
                                                "at the n-gram lookup's source where the text "
                                                "copies (0: off)."),
    copy_attention_heads: int = typer.Option(2, min=1, help="head: how many of its query "
                                             "heads --copy-attention-weight teaches."),
    copy_attention_spread: bool = typer.Option(False, help="head: teach one query head per "
                                               "key/value group in turn, not the first ones."),
    copy_attention_all_steps: bool = typer.Option(False, help="head: with --unroll-steps > 1, "
                                                  "the copy-attention loss at every unrolled "
                                                  "draft step, not only the first."),
    draft_vocab_size: int = typer.Option(32768, min=0, help="head: save the training text's N "
                                         "most frequent tokens as its draft vocabulary, the "
                                         "only ones it scores when drafting (0: none)."),
    loss_vocab: str = typer.Option("draft", help="head: the KL over the draft vocabulary "
                                   "only (draft: what the engine's head scores, most of the "
                                   "LM head's training cost saved) or the whole one (full)."),
    max_heldout_blocks: Optional[int] = typer.Option(None, min=1, help="Hold out the text's "
                                                     "last tenth of blocks, but at most this "
                                                     "many (the rest are trained on)."),
    eval_blocks: Optional[int] = typer.Option(None, min=1, help="head: held-out blocks scored "
                                              "at each evaluation (the best weights are "
                                              "scored on all of them at the end)."),
    schedule: str = typer.Option("cosine", help="Learning rate: cosine (down to a tenth over "
                                 "--steps) or constant."),
    warmup: Optional[int] = typer.Option(None, min=0, help="Linear warm-up steps (default: a "
                                         "tenth of --steps, at most 100)."),
    max_seconds: Optional[float] = typer.Option(None, min=1.0, help="Stop after this many "
                                                "seconds of training (evaluated, best kept)."),
    seed: int = typer.Option(0),
    out: str = typer.Option(..., "--out", help="Output directory (the draft, distill.json)."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda if present)."),
    dtype: str = typer.Option("auto", help="The target's dtype: auto (bf16 on a GPU, fp32 on "
                              "the CPU), bfloat16, float16 or float32. The draft trains in "
                              "fp32 and saves in the target checkpoint's dtype."),
) -> None:
    """Train a draft for speculative decoding on the target's next-token distribution: a
    smaller student or an EAGLE-style head, with held-out KL, top-1 agreement and early
    stopping."""
    from llmaccel.train.distill import distill_draft as run_distill
    from llmaccel.train.distill_common import DistillConfig

    if target is None:
        from llmaccel.models.default_model import default_model_path

        target = str(default_model_path())

    res = run_distill(DistillConfig(
        target=target, out=out, kind=kind, data=data, layers=layers, lr=lr, steps=steps,
        batch_size=batch_size, seq_len=seq_len, eval_every=eval_every, patience=patience,
        max_blocks=max_blocks, record_start=record_start, kl_weight=kl_weight,
        feature_noise=feature_noise,
        unroll_steps=unroll_steps, unroll_decay=unroll_decay, init_head=init_head,
        unroll_detach=unroll_detach, cache_features=cache_features,
        aux_layers=o.parse_int_list(aux_layers, "--aux-layers") if aux_layers else (),
        prev_token=prev_token, prev_token_init=prev_token_init,
        copy_attention_weight=copy_attention_weight, copy_attention_heads=copy_attention_heads,
        copy_attention_spread=copy_attention_spread,
        copy_attention_all_steps=copy_attention_all_steps,
        attention_init=attention_init, draft_vocab_size=draft_vocab_size,
        loss_vocab=loss_vocab, eval_blocks=eval_blocks, max_heldout_blocks=max_heldout_blocks,
        schedule=schedule, warmup=warmup, max_seconds=max_seconds, seed=seed, device=device,
        dtype=dtype))
    why = f"; stopped early: {res.stopped}" if res.stopped else ""
    method = "draft" if kind == "student" else "head"
    console.print(f"{kind}: held-out KL {res.baseline_kl:.4f} -> {res.best_kl:.4f}, top-1 "
                  f"agreement {res.baseline_top1:.1%} -> {res.best_top1:.1%} (best at step "
                  f"{res.best_step} of {res.steps_run}{why}); wrote {out} (speculative "
                  f"method \"{method}\") and {out}/distill.json", highlight=False)
