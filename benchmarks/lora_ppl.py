"""W6 before and after LoRA: WikiText-2 test perplexity of a model, then of the same model after
`llmaccel finetune` on WikiText-2's validation split (merged), both measured the same way
through our engine (context 2048, stride 2048, rows joined as `datasets` does).

    python benchmarks/lora_ppl.py --model ../models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --name smollm2-135m [--steps 400 --lr 2e-4 ...] --out benchmarks/results

The fine-tune never sees the test split: it trains on the validation text and holds out its
last tenth for early stopping. Writes <out>/<date>-W6-lora-<name>.jsonl (metric `ppl`, one
record per variant: `config.variant` = base | lora-merged) and a markdown table with the
change, the fine-tune's held-out curve and the probe generations before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import torch

ALL_PROJ = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def run(args: argparse.Namespace, command: str) -> tuple[Path, Path]:
    from llmaccel.bench.results import current_commit
    from llmaccel.eval.perplexity import evaluate_perplexity
    from llmaccel.train.lora import FinetuneConfig, finetune

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-W6-lora-{args.name}"
    jsonl, md = out / f"{stem}.jsonl", out / f"{stem}.md"
    cfg = FinetuneConfig(model=args.model, out=args.work, lora_r=args.lora_r,
                         lora_alpha=args.lora_alpha,
                         target_modules=tuple(args.target_modules.split(",")), lr=args.lr,
                         steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                         eval_every=args.eval_every, patience=args.patience, device=device,
                         dtype=args.train_dtype)
    t0 = time.perf_counter()
    result = finetune(cfg, progress=False)
    train_s = time.perf_counter() - t0
    summary = json.loads((Path(args.work) / "finetune.json").read_text())
    records = []
    for variant, path in (("base", args.model), ("lora-merged", str(Path(args.work) / "merged"))):
        t0 = time.perf_counter()
        res = evaluate_perplexity(path, context=args.context, limit=args.limit,
                                  dtype=args.dtype, device=device)
        config = {"quantization": "bf16" if args.dtype == "bfloat16" else args.dtype,
                  "variant": variant, "context": args.context, "stride": args.context,
                  "joining": "hf", "data": "wikitext2 test", "dtype": args.dtype,
                  "source": args.model, "limit_windows": args.limit,
                  "scored_tokens": res.scored_tokens, "windows": res.windows,
                  "nll": round(res.nll, 6), "seconds": round(time.perf_counter() - t0, 1)}
        if variant != "base":
            config["finetune"] = {**summary["config"], "train_blocks": summary["train_blocks"],
                                  "heldout_blocks": summary["heldout_blocks"],
                                  "data_split": "wikitext2 valid (last 10% held out)",
                                  "best_step": result.best_step, "steps_run": result.steps_run,
                                  "stopped": result.stopped, "train_s": round(train_s, 1)}
        records.append({"workload": "W6", "model": args.name, "load_format": "safetensors",
                        "backend": "llmaccel", "config": config, "metric": "ppl",
                        "value": round(res.ppl, 4), "device": gpu, "torch": torch.__version__,
                        "commit": current_commit(), "command": command})
        print(f"{args.name} {variant:>12}: ppl {res.ppl:.4f}", flush=True)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    md.write_text(markdown(records, summary, command))
    return jsonl, md


def markdown(records: list[dict], summary: dict, command: str) -> str:
    base, tuned = records[0], records[1]
    change = (tuned["value"] / base["value"] - 1) * 100
    ft = tuned["config"]["finetune"]
    lines = [f"# W6 perplexity before and after LoRA: {base['model']}", "",
             f"Device: {base['device']}; torch {base['torch']}; commit `{base['commit']}`. "
             f"Command: `{command}`", "",
             f"WikiText-2 test, context = stride = {base['config']['context']}, rows joined "
             "with a blank line, through our engine "
             f"({base['config']['dtype']}). The fine-tune trained on WikiText-2 validation "
             "(its last 10% held out for early stopping); the test split was never seen.", "",
             "| variant | ppl | change |", "|---|---|---|",
             f"| base | {base['value']:.4f} | – |",
             f"| LoRA merged | {tuned['value']:.4f} | {change:+.2f}% |", "",
             f"LoRA r={ft['lora_r']}, alpha={ft['lora_alpha']}, modules "
             f"{','.join(ft['target_modules'])}, lr {ft['lr']}, {ft['steps_run']} of "
             f"{ft['steps']} steps of {ft['batch_size']} x {ft['seq_len']} tokens "
             f"({ft['train_s']} s); best held-out at step {ft['best_step']}; stopped early: "
             f"{ft['stopped'] or 'no'}.", "",
             "| step | train loss | held-out ppl |", "|---|---|---|"]
    for row in summary["history"]:
        loss = "–" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
        lines.append(f"| {row['step']} | {loss} | {row['heldout_ppl']:.4f} |")
    first, best = summary["history"][0], next(
        r for r in summary["history"] if r["step"] == ft["best_step"])
    lines += ["", "Greedy probe generations (24 tokens), before training and at the kept step:",
              ""]
    for i, before in enumerate(first["probes"]):
        lines += [f"- before: `{before!r}`", f"  after: `{best['probes'][i]!r}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or an HF directory")
    ap.add_argument("--name", required=True, help="short model name for the records")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--target-modules", default=ALL_PROJ)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None, help="windows per variant (partial)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", help="perplexity dtype (W6: bfloat16)")
    ap.add_argument("--train-dtype", default="float32",
                    help="fine-tune dtype (float32: the small model's updates survive)")
    ap.add_argument("--work", default="runs/lora_ppl", help="the fine-tune's output directory")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    jsonl, md = run(args, "python benchmarks/lora_ppl.py " + shlex.join(argv))
    print(md.read_text())
    print(f"wrote {jsonl} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
