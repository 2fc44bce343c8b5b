"""Bar chart of W1 results (BENCHMARKS.md JSON lines): one bar per `label=file.jsonl:quant`,
the file's `metric` record (default tok_s) for that quantization preset; `...:quant#text`
takes the record one of whose comma-separated config.variant parts is `text` (files holding
several variants).

    python benchmarks/plot_w1_variants.py --out chart.png --title "..." \
        "bf16=benchmarks/results/X.jsonl:bf16" "int4=benchmarks/results/X.jsonl:gptq-int4-g128"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def value(path: str, quant: str, metric: str) -> float:
    quant, _, variant = quant.partition("#")
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        cfg = r.get("config", {})
        if (r.get("metric") == metric and cfg.get("quantization") == quant
                and (not variant or variant in
                     [p.strip() for p in str(cfg.get("variant", "")).split(",")])):
            return float(r["value"])
    raise SystemExit(f"{path}: no {metric} record for quantization {quant}"
                     + (f", variant {variant!r}" if variant else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bars", nargs="+", help="label=file.jsonl:quantization")
    ap.add_argument("--out", required=True)
    ap.add_argument("--metric", default="tok_s")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for bar in args.bars:
        label, spec = bar.split("=", 1)
        path, quant = spec.rsplit(":", 1)
        labels.append(label)
        values.append(value(path, quant, args.metric))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels)), 4.0))
    bars = ax.bar(range(len(values)), values, color="#4878a8")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(args.metric)
    ax.set_title(args.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
