"""Training throughput of a draft head, variants side by side in one process (issue 7): the
head's training step as `train_head` runs it (head_losses, backward, clip, AdamW), timed over
the same random batches from the target's cached features, with

  full-sync    the KL over the whole vocabulary, losses read back every step (sessions <= 34)
  draft-sync   the KL over the draft vocabulary (DraftHead.restrict_loss_vocab)
  draft        the same, losses read back every train.loop.READ_EVERY steps (the loop now)
  draft-b16    the same at batch 16 (tokens per second is the comparable figure)

    python benchmarks/exp_head_train_speed.py --target DIR --data TEXT [--init-head DIR] \
        --out OUT_DIR --name NAME
    python benchmarks/exp_head_train_speed.py --target qwen2.5-1.5b --out OUT_DIR --name NAME

(A shape name: random weights and random tokens, no files: a step's speed does not depend
on them.)

Prints a table and writes NAME.jsonl (one record per variant: steps/s, tokens/s, peak memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", default=None, help="training text (not for a shape name)")
    ap.add_argument("--init-head", default=None)
    ap.add_argument("--blocks", type=int, default=512, help="training blocks to cache")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default="full-sync,draft-sync,draft,draft-b16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    args = ap.parse_args()

    from llmaccel.train.distill_common import DistillConfig, load_target
    from llmaccel.train.data import load_training_text, token_blocks
    from llmaccel.train.draft_head import (build_draft_head, draft_vocabulary, load_draft_head,
                                           target_features)
    from llmaccel.train.head_training import head_losses
    from llmaccel.train.feature_cache import FeatureCache
    from llmaccel.models.shapes import SHAPES
    from llmaccel.train.loop import READ_EVERY

    if args.target in SHAPES:  # random weights and tokens: the speed is the same
        target, device = _shape_target(args.target)
        gen = torch.Generator().manual_seed(0)
        blocks = torch.randint(target.config["vocab_size"], (args.blocks, 512), generator=gen)
    else:
        cfg = DistillConfig(target=args.target, out="/tmp/unused", kind="head", seq_len=512)
        target, device = load_target(cfg)
        blocks = token_blocks(target.tokenizer, load_training_text(args.data), 512,
                              args.blocks)
    model = target.model
    head = (load_draft_head(args.init_head, model) if args.init_head
            else build_draft_head(model, target.config, args.target))
    vocab, _ = draft_vocabulary(blocks, head.embed_tokens.shape[0], 32768)
    cache = FeatureCache(model, blocks, 8, lambda m, ids: target_features(m, ids))
    on_device = blocks.to(device)
    records = []
    for variant in args.variants.split(","):
        restricted = variant.startswith("draft")
        sync_each = variant.endswith("-sync")
        batch = 16 if variant.endswith("-b16") else 8
        head.restrict_loss_vocab(vocab if restricted else None)
        params = list(head.parameters())
        opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)  # small: keep the head
        gen = torch.Generator().manual_seed(0)
        pending = []
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
            idx = torch.randint(len(blocks), (batch,), generator=gen)
            head.train()
            loss, parts = head_losses(head, model, on_device[idx.to(device)], 0.1, 0.1,
                                      features=cache[idx])
            if sync_each:  # what the loop and head_losses did before
                assert bool(torch.isfinite(loss))
                _ = [float(v) for v in parts.values()]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if sync_each:
                loss.item()
            else:
                pending.append(loss.detach())
                if len(pending) == READ_EVERY:
                    torch.stack(pending).tolist()
                    pending = []
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        rec = {"workload": "head-train", "model": args.target,
               "load_format": "dummy" if args.target in SHAPES else "auto",
               "backend": "llmaccel",
               "config": {"variant": variant, "batch": batch, "seq_len": 512,
                          "loss_vocab": "draft" if restricted else "full",
                          "read_back_every": 1 if sync_each else READ_EVERY,
                          "steps": args.steps, "seconds": round(seconds, 3),
                          "steps_per_s": round(args.steps / seconds, 3),
                          "peak_mem_gib": round(torch.cuda.max_memory_allocated(device)
                                                / 2**30, 2) if cuda else None},
               "metric": "tokens_per_s",
               "value": round(args.steps * batch * 511 / seconds, 1),
               "device": torch.cuda.get_device_name(device) if cuda else "cpu",
               "torch": torch.__version__, "commit": os.environ.get("LLMACCEL_COMMIT", ""),
               "command": " ".join(sys.argv)}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.name}.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    base = records[0]["value"]
    print(f"\n{'variant':12s} {'batch':>5s} {'steps/s':>8s} {'tokens/s':>10s} {'x':>6s} "
          f"{'peak GiB':>9s}")
    for r in records:
        c = r["config"]
        print(f"{c['variant']:12s} {c['batch']:5d} {c['steps_per_s']:8.2f} "
              f"{r['value']:10.0f} {r['value'] / base:6.2f} {c['peak_mem_gib'] or 0:9.1f}")
    return 0


def _shape_target(name: str):
    """A benchmark shape (models/shapes.py) as a random-weight transformers model, frozen."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmaccel.models.shapes import SHAPES
    from llmaccel.train.distill_common import Target

    raw = dict(SHAPES[name])
    kind = raw.pop("model_type")
    raw.pop("architectures", None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:  # initialized where it runs: a 1.5B model's init on the host is slow
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **raw), dtype=dtype)
    model.eval().requires_grad_(False)
    return Target(model, None, dict(SHAPES[name]), dtype), device


if __name__ == "__main__":
    raise SystemExit(main())
