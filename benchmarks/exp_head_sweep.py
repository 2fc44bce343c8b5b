"""Experiment (issue 7): several heads trained side by side on one set of blocks, the target
loaded and its features cached once (a fresh `warm` spends ~170 s on that per head). Each
variant trains for --seconds from the same start; the table compares what matters for
copying beside the usual agreement: step 1's top-1 at copy positions and the attention's
sink share (train/head_metrics.py), per evaluation in each distill.json.

    python benchmarks/exp_head_sweep.py --target DIR --data TEXT --out DIR \\
        --variants 'lr=5e-4;lr=1e-4;lr=1e-4,attention_init=random' --seconds 80

A variant is comma-separated DistillConfig settings (name=value; numbers, true/false or
text), trained into DIR/v<i>. Fixed for all: --prev-token, --record-start, batch size, the
held-out blocks (the first --held-blocks, scored at every evaluation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def parse_variant(spec: str) -> dict:
    """'lr=1e-4,attention_init=random' -> {'lr': 0.0001, 'attention_init': 'random'}."""
    from llmaccel.train.distill_common import DistillConfig

    fields = {f.name for f in dataclasses.fields(DistillConfig)}
    out: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"bad variant setting {part!r} (DistillConfig name=value)")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out


def tokens_per_round(score: dict) -> float:
    """1 + p1 + p1 p2 + ...: the tokens a chain of 4 drafts yields per round at these
    conditional step agreements (greedy, every round drafting 4)."""
    tok, run = 1.0, 1.0
    for key in ("heldout_top1", "heldout_top1_step2", "heldout_top1_step3",
                "heldout_top1_step4"):
        run *= score.get(key) or 0.0
        tok += run
    return tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", required=True, help="';'-separated variants")
    ap.add_argument("--seconds", type=float, default=80)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--held-blocks", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prev-token", action="store_true")
    ap.add_argument("--record-start", default=None)
    args = ap.parse_args()

    import torch

    from llmaccel.train.data import load_training_text
    from llmaccel.train.distill_common import DistillConfig, load_target, training_blocks
    from llmaccel.train.draft_head import target_features
    from llmaccel.train.feature_cache import FeatureCache
    from llmaccel.train.head_training import train_head

    base = DistillConfig(target=args.target, out="-", kind="head", data=args.data,
                         steps=1_000_000, batch_size=args.batch_size, seq_len=512,
                         eval_every=args.eval_every, heldout=0.1, patience=100,
                         max_seconds=args.seconds, prev_token=args.prev_token,
                         record_start=args.record_start, cache_features=True, seed=0)
    variants = [parse_variant(v) for v in args.variants.split(";")]
    for v in variants:
        dataclasses.replace(base, **v).check()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    target, device = load_target(base)
    train, held = training_blocks(base, target.tokenizer, load_training_text(args.data), None)
    held = held[:args.held_blocks]
    t1 = time.perf_counter()
    hidden = target.model.config.hidden_size
    caches = tuple(FeatureCache(target.model, b, args.batch_size, target_features, hidden)
                   for b in (train, held))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    print(f"blocks: {len(train)} train, {len(held)} held out; load {t1 - t0:.0f} s, "
          f"feature cache {t2 - t1:.0f} s", flush=True)
    out = Path(args.out)
    rows = []
    for i, v in enumerate(variants):
        cfg = dataclasses.replace(base, out=str(out / f"v{i}"), **v)
        torch.manual_seed(cfg.seed)
        train_head(cfg, target, train, held, device, progress=False, caches=caches)
        rec = json.loads((out / f"v{i}" / "distill.json").read_text())
        rec["variant"] = v
        (out / f"v{i}" / "distill.json").write_text(json.dumps(rec, indent=1))
        best = min(rec["history"], key=lambda r: r["heldout_kl"])
        rows.append((i, v, rec, best))
        print(json.dumps({"variant": i, **v, "steps": rec["steps_run"],
                          **{k: round(x, 4) for k, x in best.items()
                             if isinstance(x, float) and k.startswith("heldout")}}),
              flush=True)
    print("| # | variant | steps | top-1 s1 | s2 | s3 | s4 | tok/round | top-1 copy | "
          "top-1 other | copy s2/s3/s4 | attn sink | attn self |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, v, rec, b in rows:
        pct = [100 * (b.get(k) or 0) for k in ("heldout_top1", "heldout_top1_step2",
                                               "heldout_top1_step3", "heldout_top1_step4",
                                               "heldout_top1_copy", "heldout_top1_nocopy")]
        name = ",".join(f"{k}={x}" for k, x in v.items()) or "base"
        print(f"| {i} | {name} | {rec['steps_run']} | " + " | ".join(f"{p:.1f}" for p in pct[:4])
              + f" | {tokens_per_round(b):.2f} | {pct[4]:.1f} | {pct[5]:.1f} | "
              + "/".join(f"{100 * (b.get(f'heldout_top1_copy_step{j}') or 0):.1f}"
                         for j in (2, 3, 4))
              + f" | {b.get('heldout_attn_sink', 0):.2f} | {b.get('heldout_attn_self', 0):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
