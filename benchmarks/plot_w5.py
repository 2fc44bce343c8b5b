"""Plot W5 records (spec_bench.py's JSON lines): speedup over plain decoding against batch size,
one line per method and prompt kind, with the issue's floor (0.95: never more than 5% slower)
and 1.0 marked. A cell where speculation never ran (the configured crossover switched it off)
is drawn hollow.

    python benchmarks/plot_w5.py benchmarks/results/2026-11-24-W5-s9c-ngram-h100.jsonl \\
        benchmarks/results/2026-11-24-W5-s9c-draft-h100.jsonl \\
        --out benchmarks/results/2026-11-24-W5-s9c-h100.png
    python benchmarks/plot_w5.py benchmarks/results/2026-11-26-W5-overlap-h100.jsonl --bound \\
        --out benchmarks/results/2026-11-26-W5-overlap-h100.png

`--bound`: the draft model's measured speedup beside issue 6's bound, per cell.
`--bars`: configurations side by side (method, k, lookup first and how far it drafts), one bar
per prompt kind, for runs at one batch size:

    python benchmarks/plot_w5.py benchmarks/results/2026-11-28-W5-s32-head-h100.jsonl \
        benchmarks/results/2026-11-28-W5-s32-ngram-k4-h100.jsonl \
        benchmarks/results/2026-11-28-W5-s32-ngram-k7-h100.jsonl --bars \
        --out benchmarks/results/2026-11-28-s32-head-h100.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def load(paths: list[str]) -> list[dict]:
    records = []
    for p in paths:
        with open(p) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("workload") == "W5" and r.get("metric") == "speedup"]


def plot(records: list[dict], out: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str, str], list[tuple[int, float, bool]]] = defaultdict(list)
    for r in records:
        c = r["config"]
        series[c["method"], c.get("switch", "auto"), c["kind"]].append(
            (c["batch"], r["value"], c.get("spec_steps", 1) > 0))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (method, switch, kind), points in sorted(series.items()):
        points.sort()
        xs = [p[0] for p in points]
        line, = ax.plot(xs, [p[1] for p in points], marker="o",
                        label=f"{method} ({switch}), {kind}")
        off = [p for p in points if not p[2]]
        if off:  # no speculative step ran: the configured limit turned it off
            ax.scatter([p[0] for p in off], [p[1] for p in off], s=70, facecolors="white",
                       edgecolors=line.get_color(), zorder=3)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(0.95, color="red", linewidth=0.8, linestyle="--", label="0.95 (issue floor)")
    ax.set_xscale("log", base=2)
    batches = sorted({r["config"]["batch"] for r in records})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("speedup over plain decoding")
    device = records[0].get("device", "") if records else ""
    ax.set_title(title or f"W5 speculative decoding, {device}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_bound(records: list[dict], out: Path, title: str | None = None) -> Path:
    """Issue 6's bound: for each draft-model record with a bound (spec_bench's
    `speedup_bound`), the measured speedup beside E[tokens per step] / (1 + k c), labelled by
    prompt kind, batch and the configuration that differs (overlap, chain), with the share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("speedup_bound")]
    if not rows:
        raise ValueError("no records with a speedup bound (draft model, draft timed alone)")
    labels = []
    for r in rows:
        c = r["config"]
        extra = [f"{key.removeprefix('draft_')} {c[key]}" for key in ("draft_overlap",
                                                                       "draft_chain")
                 if len({x["config"].get(key) for x in rows}) > 1]
        labels.append("\n".join([f"{c['kind']}, batch {c['batch']}", *extra]))
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(rows)), 4.5))
    ax.bar([x - 0.2 for x in xs], [r["value"] for r in rows], 0.4, label="measured speedup")
    ax.bar([x + 0.2 for x in xs], [r["speedup_bound"] for r in rows], 0.4,
           label="bound E[tokens/step] / (1 + k c)", alpha=0.6)
    for x, r in zip(xs, rows):
        ax.text(x, max(r["value"], r["speedup_bound"]) + 0.02,
                f"{r['value'] / r['speedup_bound']:.1%}", ha="center", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("speedup over plain decoding")
    device = rows[0].get("device", "")
    ax.set_title(title or f"W5: draft model against its bound (share above bars)\n{device}",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def config_label(config: dict) -> str:
    """A W5 configuration as a bar group's label: method and k, then the options that change
    what drafts (a head's draft vocabulary, ngram_first and how far its lookup drafts)."""
    parts = [f"{config['method']} k={config.get('k', '?')}"]
    if config.get("draft_vocab_size"):
        parts.append(f"vocab {config['draft_vocab_size']}")
    if config.get("ngram_first"):
        most = config.get("prompt_lookup_num_tokens")
        parts.append("lookup first" + (f", up to {most}" if most else ""))
    return "\n".join(parts)


def bar_stats(values: list[float]) -> tuple[float, float, float, int]:
    """(median, min, max, count) of one bar's records; an absent cell is (0, 0, 0, 0)."""
    if not values:
        return 0.0, 0.0, 0.0, 0
    return statistics.median(values), min(values), max(values), len(values)


def plot_bars(records: list[dict], out: Path, title: str | None = None) -> Path:
    """Speedup per configuration (config_label), one bar per prompt kind, values above the
    bars; for records of one batch size (several are an error: use the line plot). Several
    records of one configuration and kind (engines run again, in one lease or several) are
    drawn as their median with a min-max bar and their count, never the last alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = {r["config"]["batch"] for r in records}
    if len(batches) != 1:
        raise ValueError(f"--bars wants records of one batch size, got {sorted(batches)}")
    labels: list[str] = []
    values: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in records:
        label = config_label(r["config"])
        if label not in labels:
            labels.append(label)
        values[label, r["config"]["kind"]].append(r["value"])
    kinds = sorted({kind for _, kind in values})
    width = 0.8 / len(kinds)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5))
    top = 1.0
    for i, kind in enumerate(kinds):
        xs = [x + (i - (len(kinds) - 1) / 2) * width for x in range(len(labels))]
        cells = [bar_stats(values.get((label, kind), [])) for label in labels]
        top = max(top, *(c[2] for c in cells))
        ys = [c[0] for c in cells]
        err = [[c[0] - c[1] for c in cells], [c[2] - c[0] for c in cells]]
        many = any(c[3] > 1 for c in cells)
        ax.bar(xs, ys, width, label=kind, yerr=err if many else None, capsize=3)
        for x, (y, _, hi, n) in zip(xs, cells):
            text = f"{y:.2f}x" + (f"\n(n={n})" if n > 1 else "")
            ax.text(x, hi + 0.02, text, ha="center", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylim(0, top * 1.18)  # room for the values and the legend above the tallest bar
    ax.set_xticks(list(range(len(labels))), labels, fontsize=8)
    ax.set_ylabel("speedup over plain decoding")
    device = records[0].get("device", "")
    ax.set_title(title or f"W5 at batch {batches.pop()}, {device}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="spec_bench JSON-lines files")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default=None)
    ap.add_argument("--bound", action="store_true",
                    help="bars of the draft model's speedup against its bound instead")
    ap.add_argument("--bars", action="store_true",
                    help="bars per configuration and prompt kind (records of one batch size)")
    args = ap.parse_args(argv)
    records = load(args.files)
    if not records:
        raise SystemExit("no W5 speedup records in " + ", ".join(args.files))
    draw = plot_bound if args.bound else plot_bars if args.bars else plot
    print(draw(records, Path(args.out), args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
