"""Experiment (issue 7): does training on the head's own drafts help its later draft steps
once it has a plain warm start? One plain head, then continuations from it with the same
step budget: plain, unrolled (EAGLE-3's training-time test) with decayed later steps, and
the same with the fed-back drafts detached. Held-out top-1 agreement at draft steps 1-4 of
each (`evaluate_head`).

    python benchmarks/exp_head_unroll.py --target GGUF --data TEXT --stage warm --out DIR
    python benchmarks/exp_head_unroll.py --target GGUF --data TEXT --stage continue --out DIR

`warm` trains DIR/warm (--warm-steps, --warm-seconds; from --init-head where given);
`continue` trains DIR/<variant> from it for --steps / --seconds each and prints a table of the
final evaluations (with --eval-blocks, the best weights on every held-out block). distill.json
of each head holds its settings and every evaluation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VARIANTS = {
    "plain": {},
    "unroll3-decay0.5": {"unroll_steps": 3, "unroll_decay": 0.5},
    "unroll3-decay0.5-detach": {"unroll_steps": 3, "unroll_decay": 0.5, "unroll_detach": True},
    # the KL over the whole vocabulary, as sessions <= 34 trained (2.4x slower a step)
    "full-vocab": {"loss_vocab": "full"},
    # the KL (top-1 agreement is what acceptance needs) weighted like the regression
    "kl1": {"kl_weight": 1.0},
    "kl1-unroll3-detach": {"kl_weight": 1.0, "unroll_steps": 3, "unroll_decay": 0.5,
                           "unroll_detach": True},
}


def _train(target: str, data: str, out: Path, steps: int, seconds: float, lr: float | None,
           eval_every: int, **kw) -> dict:
    from llmaccel.train.distill import distill_draft
    from llmaccel.train.distill_common import DistillConfig

    settings = dict(batch_size=8, kl_weight=0.1, feature_noise=0.1)  # a variant may change
    settings.update(kw)
    cfg = DistillConfig(target=target, out=str(out), kind="head", data=data, steps=steps,
                        seq_len=512, eval_every=eval_every, heldout=0.1, patience=100, lr=lr,
                        max_seconds=seconds, seed=0, **settings)
    distill_draft(cfg)
    return json.loads((out / "distill.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", choices=["warm", "continue"], required=True)
    ap.add_argument("--warm-steps", type=int, default=1500)
    ap.add_argument("--warm-seconds", type=float, default=170)
    ap.add_argument("--init-head", default=None,
                    help="warm: go on from this saved head (an earlier session's) instead of a "
                         "fresh one")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=100)
    ap.add_argument("--lr", type=float, default=2e-4,
                    help="continuations' peak lr (and warm's, with --init-head)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--aux-layers", default="",
                    help="warm: EAGLE-3's multi-layer features, e.g. 2,14 (DistillConfig."
                         "aux_layers; continuations take the warm head's)")
    ap.add_argument("--prev-token", action="store_true",
                    help="warm: the head also reads the token at each feature's position "
                         "(DistillConfig.prev_token; from a plain --init-head, fc's new part "
                         "starts fresh); continuations take the warm head's")
    ap.add_argument("--prev-token-init", type=float, default=0.1,
                    help="warm: the scale the previous token's part of fc starts at")
    ap.add_argument("--attention-init", default="target", choices=["target", "random"],
                    help="warm: the layer's q/k from the target's last layer (or from "
                         "--init-head) or drawn afresh")
    ap.add_argument("--warm-variant", default="plain", choices=list(VARIANTS),
                    help="warm: train with this variant's settings (e.g. kl1)")
    ap.add_argument("--cache-features", action="store_true",
                    help="the target's features computed once per block, kept on the device "
                         "(train/feature_cache.py), not once per step")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=500, help="warm: steps between "
                    "evaluations (continuations: half their steps)")
    ap.add_argument("--eval-blocks", type=int, default=None,
                    help="held-out blocks scored while training (DistillConfig.eval_blocks; "
                         "all of them at the end)")
    ap.add_argument("--max-heldout-blocks", type=int, default=None,
                    help="held out: the text's last tenth of blocks, at most this many "
                         "(DistillConfig.max_heldout_blocks)")
    ap.add_argument("--loss-vocab", default="draft", choices=["draft", "full"])
    ap.add_argument("--record-start", default=None,
                    help="blocks start at records beginning with this string "
                         "(DistillConfig.record_start, e.g. '<|im_start|>system')")
    ap.add_argument("--copy-attention-weight", type=float, default=0.0,
                    help="warm: DistillConfig.copy_attention_weight (the copy-attention loss)")
    ap.add_argument("--copy-attention-heads", type=int, default=2)
    ap.add_argument("--copy-attention-spread", action="store_true",
                    help="warm: the taught heads one per key/value group in turn")
    ap.add_argument("--copy-attention-all-steps", action="store_true",
                    help="warm: with an unrolled --warm-variant, the copy-attention loss at "
                         "every unrolled step (DistillConfig.copy_attention_all_steps)")
    ap.add_argument("--warm-lr", type=float, default=None,
                    help="warm without --init-head: its peak lr (default the head's 5e-4)")
    args = ap.parse_args()
    common = dict(batch_size=args.batch_size, eval_blocks=args.eval_blocks,
                  max_heldout_blocks=args.max_heldout_blocks,
                  loss_vocab=args.loss_vocab, record_start=args.record_start)
    out = Path(args.out)
    aux = tuple(int(i) for i in args.aux_layers.split(",") if i.strip())
    if args.stage == "warm":
        rec = _train(args.target, args.data, out / "warm", args.warm_steps, args.warm_seconds,
                     args.lr if args.init_head else args.warm_lr, args.eval_every,
                     init_head=args.init_head, cache_features=args.cache_features,
                     aux_layers=aux, prev_token=args.prev_token,
                     prev_token_init=args.prev_token_init,
                     attention_init=args.attention_init,
                     copy_attention_weight=args.copy_attention_weight,
                     copy_attention_heads=args.copy_attention_heads,
                     copy_attention_spread=args.copy_attention_spread,
                     copy_attention_all_steps=args.copy_attention_all_steps,
                     **{**common, **VARIANTS[args.warm_variant]})
        print(json.dumps({k: rec[k] for k in ("best_kl", "best_top1", "best_step",
                                               "steps_run", "stopped")}))
        return 0
    rows = {}
    for name in args.variants.split(","):
        rec = _train(args.target, args.data, out / name, args.steps, args.seconds, args.lr,
                     args.steps // 2, init_head=str(out / "warm"),
                     cache_features=args.cache_features, aux_layers=aux,
                     prev_token=args.prev_token, **{**common, **VARIANTS[name]})  # a variant's settings win
        rows[name] = rec
    print("| variant | steps run | seconds | top-1 step 1 | step 2 | step 3 | step 4 | "
          "tokens/round at k=4 |\n|---|---|---|---|---|---|---|---|")
    for name, rec in rows.items():
        last = rec["history"][-1]
        # the best weights on every held-out block where training scored only some
        score = rec.get("final_heldout", last)
        p = [score.get("heldout_top1")] + [score.get(f"heldout_top1_step{j}")
                                           for j in (2, 3, 4)]
        tok, run = 1.0, 1.0
        for v in p:
            run *= v or 0.0
            tok += run
        print(f"| {name} | {rec['steps_run']} | {last.get('seconds', '')} | "
              + " | ".join(f"{100 * (v or 0):.1f}%" for v in p) + f" | {tok:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
