"""Experiment (issue 7): does a head that also reads the token at each feature's position
(DistillConfig.prev_token) copy better than EAGLE-1's head? Both trained side by side, same
data, steps and seed, then scored on held-out blocks: top-1 agreement at draft steps 1-4 and
the tokens per round at k = 4 those imply.

    python benchmarks/exp_head_prev_token.py --target GGUF --out DIR [--data TEXT | --copy N]

`--copy N`: the text is N WikiText-2 validation paragraphs (../shared/data), each cut to its
first ~400 characters and written twice, so half of every block is a copy of what came
before: what rewriting and quoting prompts (W5) make a target do. Without a GPU, run it on a
small target (SmolLM2-135M) with a small draft vocabulary.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def copy_text(n: int, chars: int = 400) -> str:
    """N WikiText-2 validation paragraphs, each cut at a word boundary near `chars` and
    written twice."""
    from llmaccel.train.data import load_training_text

    paragraphs = [p.strip() for p in load_training_text("wikitext2").split("\n")
                  if len(p.strip()) > chars and not p.strip().startswith("=")]
    out = []
    for p in paragraphs[:n]:
        cut = p[:chars].rsplit(" ", 1)[0]
        out.append(f"{cut}\n{cut}\n")
    return "\n".join(out)


def tokens_per_round(rec: dict) -> tuple[list[float], float]:
    score = rec.get("final_heldout", rec["history"][-1])
    p = [score.get("heldout_top1")] + [score.get(f"heldout_top1_step{j}") for j in (2, 3, 4)]
    tok, run = 1.0, 1.0
    for v in p:
        run *= v or 0.0
        tok += run
    return p, tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None, help="a text file (default: --copy)")
    ap.add_argument("--copy", type=int, default=300, help="paragraphs of the copy text")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--unroll-steps", type=int, default=1)
    ap.add_argument("--variants", default="plain,prev-token")
    args = ap.parse_args()

    from llmaccel.train.distill import distill_draft
    from llmaccel.train.distill_common import DistillConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = args.data
    if data is None:
        data = str(out / "copy.txt")
        Path(data).write_text(copy_text(args.copy), encoding="utf-8")
    rows = {}
    for name in args.variants.split(","):
        start = time.perf_counter()
        cfg = DistillConfig(target=args.target, out=str(out / name), kind="head", data=data,
                            steps=args.steps, seq_len=args.seq_len,
                            batch_size=args.batch_size, eval_every=max(args.steps // 4, 1),
                            patience=100, lr=args.lr, max_seconds=args.seconds,
                            draft_vocab_size=args.draft_vocab_size, cache_features=True,
                            unroll_steps=args.unroll_steps, seed=0,
                            prev_token=name == "prev-token")
        distill_draft(cfg, progress=False)
        rec = json.loads((out / name / "distill.json").read_text())
        rows[name] = (rec, time.perf_counter() - start)
    print("| head | steps | seconds | top-1 step 1 | step 2 | step 3 | step 4 | KL | "
          "tokens/round at k=4 |\n|---|---|---|---|---|---|---|---|---|")
    for name, (rec, seconds) in rows.items():
        p, tok = tokens_per_round(rec)
        score = rec.get("final_heldout", rec["history"][-1])
        print(f"| {name} | {rec['steps_run']} | {seconds:.0f} | "
              + " | ".join(f"{v:.1%}" for v in p)
              + f" | {score['heldout_kl']:.3f} | {tok:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
