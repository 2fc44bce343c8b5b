"""Plot one exp_w4_wgmma.py run: per llama-3.2-3b shape and row count, microseconds a call of
cuBLAS on bf16 weights, dequantize + cuBLAS, the mma.sync W4A16 GEMM and the wgmma W4A16 GEMM
(its default tile), all measured in that run.

    python benchmarks/plot_w4_wgmma.py RUN.jsonl OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = (("cublas_bf16_us", "cuBLAS, bf16 weights"), ("dequant_cublas_us", "dequantize + cuBLAS"),
          ("gemm_w4_us", "mma.sync W4A16 GEMM"), ("wgmma_default_us", "wgmma W4A16 GEMM"))


def main(src: str, out: str) -> int:
    recs = [json.loads(line) for line in Path(src).read_text().splitlines() if line.strip()]
    shapes = list(dict.fromkeys(r["shape"] for r in recs))
    rows = sorted({r["m"] for r in recs})
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), sharey=False)
    for ax, m in zip(axes if len(rows) > 1 else [axes], rows):
        by = {r["shape"]: r for r in recs if r["m"] == m}
        width = 0.8 / len(SERIES)
        for i, (key, label) in enumerate(SERIES):
            xs = [j + (i - (len(SERIES) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, [by[s][key] for s in shapes], width, label=label)
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_title(f"{m} rows")
        ax.set_ylabel("us a call")
    first = recs[0]
    fig.suptitle(f"W4A16 products on the llama-3.2-3b shapes, group {first['group']}, "
                 f"{first.get('scale_dtype', 'bfloat16')} scales ({first['device']}, "
                 f"commit {first['commit']})", fontsize=10)
    (axes[0] if len(rows) > 1 else axes).legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
