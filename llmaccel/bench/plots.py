"""PNG plots for `llmaccel report`, one function each. Every function takes records (or
per-request rows), writes `<out_dir>/<name>.png` and returns a `PlotResult`; with no data for
it, it writes nothing and returns path None with the reason.

Figures are `matplotlib.figure.Figure` objects on the Agg canvas, not pyplot: no global state,
no display, nothing to close.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from llmaccel.bench.report import (
    TITLES,
    PlotResult,
    assign_rows,
    is_number,
    join_ppl_speed,
    load_x,
    natural_key,
    num_text,
    pareto_front,
)
from llmaccel.bench.results import Record

DPI = 110
MAX_LEGEND = 50
X_LABELS = {"concurrency": "max concurrency (requests in flight)",
            "request rate": "request rate (req/s)"}


def _figure(ncols: int = 1, width: float = 6.4, height: float = 4.2) -> tuple[Figure,
                                                                              list[Axes]]:
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _save(fig: Figure, out_dir: str | Path, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=DPI)
    return path


def _skip(name: str, reason: str) -> PlotResult:
    return PlotResult(name, TITLES[name], None, reason)


def _devices(records: Iterable[Record]) -> str:
    return ", ".join(dict.fromkeys(r.device for r in records))


def _log_x(ax: Axes, xs: Iterable[float], base: int = 2) -> None:
    """Log x axis with a tick at every value present (load points, batch sizes)."""
    ticks = sorted({x for x in xs if x > 0})
    if not ticks:
        return
    ax.set_xscale("log", base=base)
    ax.set_xticks(ticks, [num_text(t) for t in ticks])
    ax.minorticks_off()


def _legend(ax: Axes, lines: int, small: bool = False) -> list[str]:
    """A legend inside for a few lines, beside the axes for many, none past MAX_LEGEND (it
    would hide the plot); returns a note when left out. `small`: a panel of several, whose
    legend stays inside in a smaller font."""
    if lines > MAX_LEGEND:
        return [f"{lines} lines: too many to label; pass fewer files for a legend"]
    if small:
        ax.legend(fontsize=6)
    elif lines <= 10:
        ax.legend(fontsize=8)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  ncol=1 if lines <= 25 else 2)
    return []


def _spread(values: Sequence[float]) -> float:
    pos = [v for v in values if v > 0]
    return max(pos) / min(pos) if pos else 1.0


# -- W3: throughput and TTFT against load ------------------------------------------------------
def _serving_series(records: Iterable[Record], metrics: Sequence[str], commands: Sequence[str]
                    ) -> tuple[dict[str, dict[str, dict[str, list[tuple[float, float]]]]],
                               list[Record], list[str]]:
    """x kind -> line label -> metric -> [(x, value)], the records used, and the load points
    that have no place on a load axis (all at once without a cap)."""
    w3 = [r for r in records if r.workload == "W3" and r.metric in metrics]
    rows = assign_rows(w3, commands)
    many_models = len({r.model for r in w3}) > 1
    series: dict[str, dict[str, dict[str, list[tuple[float, float]]]]] = {}
    dropped: list[str] = []
    for r, row in zip(w3, rows):
        label = row.series_label(drop_point=True)
        if many_models:
            label = f"{r.model} · {label}"
        x = load_x(r.config)
        if x is None:
            dropped.append(f"{label} @ {row.point[0]}")
            continue
        rate = r.config.get("request_rate")
        if x[0] == "concurrency" and isinstance(rate, (int, float)) and math.isfinite(rate):
            label += f" · rate={num_text(rate)}"  # a capped sweep at one finite rate
        series.setdefault(x[0], {}).setdefault(label, {}).setdefault(r.metric, []).append(
            (x[1], r.value))
    return series, w3, list(dict.fromkeys(dropped))


def plot_throughput_vs_load(records: Iterable[Record], out_dir: str | Path,
                            commands: Sequence[str] = ()) -> PlotResult:
    """W3 out_tok_s against max_concurrency (or request rate), one line per backend."""
    name = "throughput_vs_load"
    series, used, dropped = _serving_series(records, ("out_tok_s",), commands)
    if not used:
        return _skip(name, "no W3 records with metric out_tok_s")
    if not series:
        return _skip(name, "no W3 load point has a max_concurrency or a finite request_rate "
                     f"to put on a load axis ({'; '.join(dropped)})")
    most = max(len(lines) for lines in series.values())
    fig, axes = _figure(len(series), width=6.4 if most <= 10 else 9.0)
    legend_notes: list[str] = []
    for ax, (kind, lines) in zip(axes, series.items()):
        xs = []
        for i, (label, by_metric) in enumerate(lines.items()):
            pts = sorted(by_metric["out_tok_s"])
            xs += [p[0] for p in pts]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                    label=label)
        _log_x(ax, xs)
        ax.set_xlabel(X_LABELS[kind] + ", log scale")
        ax.set_ylabel("output tok/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        legend_notes += _legend(ax, len(lines))
    fig.suptitle(f"W3 output throughput vs load ({_devices(used)})")
    models = ", ".join(dict.fromkeys(r.model for r in used))
    return PlotResult(name, TITLES[name], _save(fig, out_dir, name),
                      caption=f"W3 `out_tok_s` at each load point, one line per backend; "
                              f"model {models}; log x axis.",
                      notes=[f"not on a load axis (all at once, no cap): {d}" for d in dropped]
                      + legend_notes[:1])


def plot_ttft_vs_load(records: Iterable[Record], out_dir: str | Path,
                      commands: Sequence[str] = ()) -> PlotResult:
    """W3 TTFT p50 (solid) and p99 (dashed) against load, one colour per backend."""
    name = "ttft_vs_load"
    series, used, dropped = _serving_series(records, ("ttft_ms_p50", "ttft_ms_p99"), commands)
    if not used:
        return _skip(name, "no W3 records with metric ttft_ms_p50 or ttft_ms_p99")
    if not series:
        return _skip(name, "no W3 load point has a max_concurrency or a finite request_rate "
                     f"to put on a load axis ({'; '.join(dropped)})")
    most = max(len(lines) for lines in series.values())
    fig, axes = _figure(len(series), width=6.4 if 2 * most <= 10 else 9.0)
    legend_notes: list[str] = []
    for ax, (kind, lines) in zip(axes, series.items()):
        xs, ys = [], []
        for i, (label, by_metric) in enumerate(lines.items()):
            for metric, style in (("ttft_ms_p50", "o-"), ("ttft_ms_p99", "s--")):
                pts = sorted(by_metric.get(metric, []))
                if pts:
                    xs += [p[0] for p in pts]
                    ys += [p[1] for p in pts]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=f"C{i}",
                            label=f"{label} {metric.rsplit('_', 1)[1]}")
        _log_x(ax, xs)
        if _spread(ys) > 20:  # an overloaded point would flatten the others
            ax.set_yscale("log")
        ax.set_xlabel(X_LABELS[kind] + ", log scale")
        ax.set_ylabel("TTFT (ms)")
        ax.grid(alpha=0.3)
        legend_notes += _legend(ax, 2 * len(lines))
    fig.suptitle(f"W3 time to first token vs load ({_devices(used)})")
    return PlotResult(name, TITLES[name], _save(fig, out_dir, name),
                      caption="W3 `ttft_ms_p50` (solid) and `ttft_ms_p99` (dashed) at each load "
                              "point, one colour per backend; log x axis.",
                      notes=[f"not on a load axis (all at once, no cap): {d}" for d in dropped]
                      + legend_notes[:1])


# -- latency CDFs from the per-request sidecars (W1, W2, W3, W4 alike) -------------------------
CDF_PANELS = (("TTFT", "ttft_ms"), ("E2E latency", "e2e_ms"), ("ITL", "itl_ms"))


def _transport(backend: str) -> str | None:
    """How a backend's requests were sent: "over HTTP" (openai:<server>), "in process" (our
    engine, the HF baselines), None for a name that does not say."""
    if backend == "openai" or backend.startswith("openai:"):
        return "over HTTP"
    if backend == "llmaccel" or backend.startswith("hf-"):
        return "in process"
    return None


def cdf_source(requests: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """What the rows themselves say about where they came from: the workloads they name
    ("W1, W2"; "" for none, see report.tag_workloads) and the facts for a parenthesis (in
    process or over HTTP where the backend names say, rows naming no workload). Nothing the
    rows do not say is claimed."""
    workloads = sorted({str(r["workload"]) for r in requests if r.get("workload")},
                       key=natural_key)
    ways = {_transport(str(r.get("backend", ""))) for r in requests}
    facts: list[str] = []
    known = " and ".join(w for w in ("in process", "over HTTP") if w in ways)
    if known:
        facts.append(known + (", some backends unknown" if None in ways else ""))
    if any(not r.get("workload") for r in requests):
        facts.append("some rows name no workload" if workloads else "workload not recorded")
    return ", ".join(workloads), "; ".join(facts)


def cdf_title(requests: Sequence[Mapping[str, Any]]) -> str:
    """E.g. "W2 per-request latency CDFs (in process)"."""
    workloads, facts = cdf_source(requests)
    head = f"{workloads} per-request" if workloads else "Per-request"
    return f"{head} latency CDFs" + (f" ({facts})" if facts else "")


def _numbers(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def plot_latency_cdfs(requests: Sequence[Mapping[str, Any]], out_dir: str | Path,
                      missing: Sequence[str] = ()) -> PlotResult:
    """Empirical CDFs of TTFT, E2E and ITL (one subplot each) over successful requests, one
    curve per backend × load (and variant, and workload where rows of several are drawn);
    titled with the workloads the rows name. `missing`: expected sidecars that are not there
    (for the reason or a note)."""
    name = "latency_cdf"
    if not requests:
        where = (f"missing: {', '.join(missing)}" if missing
                 else "no <result>.requests.jsonl beside any input file")
        return _skip(name, f"no per-request rows ({where})")
    many_models = len({str(r.get("model", "")) for r in requests}) > 1
    # W2 and W4 rows both say load "all-at-once", and W4's prefix-cache-off and -on rows
    # share a backend: the workload and the variant keep each in a curve of its own
    many_workloads = len({str(r.get("workload") or "?") for r in requests}) > 1
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in requests:
        variant = f" [{row['variant']}]" if row.get("variant") else ""
        label = f"{row['backend']}{variant} @ {row.get('load') or '?'}"
        if many_workloads:
            label = f"{row.get('workload') or '?'} · {label}"
        if many_models:
            label = f"{row.get('model', '?')} · {label}"
        groups.setdefault(label, []).append(row)
    groups = dict(sorted(groups.items(), key=lambda kv: natural_key(kv[0])))
    fig, axes = _figure(3, width=5.0, height=4.2 + 0.2 * min(len(groups), MAX_LEGEND) / 3)
    colors = {label: f"C{i}" for i, label in enumerate(groups)}
    drawn: dict[str, Any] = {}  # label -> a line, for the one legend
    for ax, (title, key) in zip(axes, CDF_PANELS):
        all_values: list[float] = []
        for label, rows in groups.items():
            ok = [row for row in rows if row.get("success") is True]
            if key == "itl_ms":
                values = _numbers(v for row in ok for v in (row.get(key) or []))
            else:
                values = _numbers(row.get(key) for row in ok)
            if not values:
                continue
            values.sort()
            n = len(values)
            (line,) = ax.step(values, [(j + 1) / n for j in range(n)], where="post",
                              color=colors[label])
            drawn.setdefault(label, line)
            all_values += values
        if _spread(all_values) > 50:
            ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel(f"{key.replace('_ms', '')} (ms)" + (", log scale"
                                                           if _spread(all_values) > 50 else ""))
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if not drawn:
        return _skip(name, f"the {len(requests)} request rows hold no successful request "
                     "with latencies")
    notes = []
    if len(drawn) <= MAX_LEGEND:
        ok_counts = {label: sum(1 for row in groups[label] if row.get("success") is True)
                     for label in drawn}
        fig.legend(list(drawn.values()), [f"{k} ({ok_counts[k]} ok)" for k in drawn],
                   loc="outside lower center", ncol=min(4, len(drawn)), fontsize=8)
    else:
        notes.append(f"{len(drawn)} curves: too many to label; pass fewer files for a legend")
    title = cdf_title(requests)
    fig.suptitle(f"{title}, successful requests")
    for label, rows in groups.items():
        failed = sum(1 for row in rows if row.get("success") is not True)
        if failed:
            notes.append(f"{label}: {failed} of {len(rows)} requests failed (not in the CDFs)")
    notes += [f"no sidecar: {m}" for m in missing]
    workloads, facts = cdf_source(requests)
    source = ", ".join(f for f in (workloads, facts) if f)
    return PlotResult(name, title, _save(fig, out_dir, name),
                      caption="Empirical CDFs over the successful requests of the "
                              "`.requests.jsonl` sidecars" + (f" ({source})" if source else "")
                              + ", one curve per backend × load point; ITL pools every gap "
                              "between successive chunks.",
                      notes=notes)


# -- W6 x W1: perplexity against speed per quantization format ---------------------------------
def plot_ppl_vs_speed(records: Iterable[Record], out_dir: str | Path,
                      reference_variant: str | None = None) -> PlotResult:
    """Each format at (W1 tok_s, W6 ppl), joined on config.quantization; the Pareto front
    (fast and accurate) marked. `reference_variant`: the unquantized variant the formats were
    made from, plotted as its dtype (a recipe's fine-tuned model)."""
    name = "ppl_vs_tok_s"
    records = list(records)
    join = join_ppl_speed(records, reference_variant)
    if join is None:
        n_ppl = sum(1 for r in records if r.workload == "W6" and r.metric == "ppl")
        n_tok = sum(1 for r in records if r.workload == "W1" and r.metric == "tok_s")
        return _skip(name, "needs W6 `ppl` and W1 `tok_s` records that name "
                     f"config.quantization (have {n_ppl} W6 ppl and {n_tok} W1 tok_s "
                     "records)")
    if len(join.points) < 2:
        return _skip(name, f"fewer than two formats on both sides: W6 {join.ppl_model} has "
                     f"{', '.join(join.ppl_only + list(join.points)) or 'none'}; W1 "
                     f"{join.speed_model} has "
                     f"{', '.join(join.speed_only + list(join.points)) or 'none'}")
    front = pareto_front(join.points)
    fig, (ax,) = _figure(width=7.2, height=4.8)
    for fmt, (speed, ppl) in join.points.items():
        on = fmt in front
        ax.scatter([speed], [ppl], s=60 if on else 35, zorder=3,
                   color="C3" if on else "C0", edgecolors="black" if on else "none")
        ax.annotate(fmt, (speed, ppl), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.plot([join.points[f][0] for f in front], [join.points[f][1] for f in front], "--",
            color="C3", linewidth=1, label="Pareto front")
    ax.set_xlabel(f"tok/s at batch 1 — W1, {join.speed_model} ({join.speed_device})")
    ax.set_ylabel(f"perplexity — W6, {join.ppl_model} (lower is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Quantization formats: perplexity vs speed")
    ref = (f" The unquantized point is the `{reference_variant}` variant, the model the "
           "quantized formats were made from." if reference_variant else "")
    source = ("The two axes come from different models" if join.speed_model != join.ppl_model
              else "The two axes come from different workloads of one model")
    caption = (f"{source}, joined on the format name "
               f"(`config.quantization`): tok/s from W1 records of {join.speed_model} on "
               f"{join.speed_device}, perplexity from W6 records of {join.ppl_model}. "
               f"Pareto front (no other format is both at least as fast and at most as "
               f"perplexed): {', '.join(front)}.{ref}")
    notes = []
    if join.ppl_only:
        notes.append(f"perplexity only (no W1 tok_s for {join.speed_model}): "
                     f"{', '.join(join.ppl_only)}")
    if join.speed_only:
        notes.append(f"speed only (no W6 ppl for {join.ppl_model}): "
                     f"{', '.join(join.speed_only)}")
    several = [f"{f} ({s} tok_s, {p} ppl)" for f, (s, p) in join.candidates.items()
               if s > 1 or p > 1]
    if several:
        notes.append("several records per format, the best of each kept (highest tok_s, "
                     f"lowest ppl): {', '.join(several)}")
    if join.not_used:
        notes.append(f"not plotted (fewer formats in common): {', '.join(join.not_used)}")
    return PlotResult(name, TITLES[name], _save(fig, out_dir, name), caption=caption,
                      notes=notes)


# -- W5: acceptance by position, speedup by batch ----------------------------------------------
def _spec_steps(config: Mapping[str, Any]) -> float | None:
    """Speculative steps a W5 run made: `spec_steps` (benchmarks/spec_bench.py) or
    `spec_counters.num_steps` (`llmaccel bench spec`); None when the record says neither."""
    if is_number(config.get("spec_steps")):
        return float(config["spec_steps"])
    counters = config.get("spec_counters")
    if isinstance(counters, Mapping) and is_number(counters.get("num_steps")):
        return float(counters["num_steps"])
    return None


def _panels(records: Sequence[Record]) -> list[str | None]:
    """One panel per target quantization when W5 runs span several (a recipe's variants:
    24 lines on one axes read as noise); else one panel."""
    quants = sorted({str(r.config["quantization"]) for r in records
                     if r.config.get("quantization") not in (None, "")}, key=natural_key)
    return quants if len(quants) > 1 else [None]


def _in_panel(r: Record, panel: str | None) -> bool:
    return panel is None or str(r.config.get("quantization")) == panel


def _drop_quant(label: str, panel: str | None) -> str:
    """A line's label inside its quantization's panel: the panel title says the format."""
    return label if panel is None else label.replace(f" [{panel}]", "").replace(
        f", {panel}]", "]")


def plot_acceptance_by_position(records: Iterable[Record], out_dir: str | Path,
                                commands: Sequence[str] = ()) -> PlotResult:
    """W5 config.per_position_acceptance (positions 1..k), one line per method × kind ×
    batch; one panel per target quantization when there are several. Runs that drafted
    nothing (speculation switched off) have no acceptance to draw and are left out."""
    name = "acceptance_by_position"
    w5 = [r for r in records if r.workload == "W5"
          and isinstance(r.config.get("per_position_acceptance"), list)]
    rows = assign_rows(w5, commands)
    kept = [(r, row) for r, row in zip(w5, rows) if _spec_steps(r.config) != 0]
    off = {row.label for r, row in zip(w5, rows) if _spec_steps(r.config) == 0}
    if not kept:
        return _skip(name, "no W5 record has config.per_position_acceptance (a list of "
                     "acceptance rates by draft position) from a run that drafted")
    many_models = len({r.model for r, _ in kept}) > 1
    panels = _panels([r for r, _ in kept])
    # label -> (panel, series, batch, values)
    lines: dict[str, tuple[str | None, str, str, list[float]]] = {}
    for r, row in kept:
        prefix = f"{r.model} · " if many_models else ""
        values = _numbers(r.config["per_position_acceptance"])
        panel = next(p for p in panels if _in_panel(r, p))
        if values and len(values) == len(r.config["per_position_acceptance"]):
            # every metric record of a run carries the same list: the first is kept
            lines.setdefault(prefix + row.label, (
                panel, prefix + _drop_quant(row.series_label(drop_point=True), panel),
                row.point[-1], values))
    if not lines:
        return _skip(name, "no W5 record has a numeric config.per_position_acceptance")
    # colour: method × kind; line style and marker: batch size
    colors = {s: f"C{i % 10}" for i, s in enumerate(sorted({v[1] for v in lines.values()},
                                                           key=natural_key))}
    batches = sorted({v[2] for v in lines.values()}, key=natural_key)
    styles = {b: (["-", "--", ":", "-."][i % 4], "os^Dv*"[i % 6]) for i, b in enumerate(batches)}
    multi = len(panels) > 1
    fig, axes = _figure(ncols=len(panels), width=4.6 if multi else
                        (7.2 if len(lines) <= 10 else 10.0), height=4.6)
    k = max(len(v[3]) for v in lines.values())
    notes: list[str] = []
    for ax, panel in zip(axes, panels):
        mine = sorted(((lab, v) for lab, v in lines.items() if v[0] == panel),
                      key=lambda kv: natural_key(kv[0]))
        for label, (_, series, batch, values) in mine:
            ax.plot(range(1, len(values) + 1), values, color=colors[series],
                    linestyle=styles[batch][0], marker=styles[batch][1],
                    label=_drop_quant(label, panel))
        ax.set_xticks(range(1, k + 1))
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if multi:
            ax.set_title(f"target {panel}", fontsize=10)
        notes += _legend(ax, len(mine), small=multi)
    axes[0].set_ylabel("acceptance rate")
    title = f"W5 acceptance by draft position ({_devices(w5)})"
    (fig.suptitle if multi else axes[0].set_title)(title)
    if off:
        notes.append(f"{len(off)} runs drafted nothing (switched off at their batch size) "
                     "and are not drawn")
    return PlotResult(name, TITLES[name], _save(fig, out_dir, name),
                      caption="Share of drafted tokens accepted at each draft position, one "
                              "line per method × prompt kind × batch (colour: method × kind; "
                              "line style: batch)" + ("; one panel per target quantization."
                                                      if multi else "."), notes=notes)


def plot_speedup_vs_batch(records: Iterable[Record], out_dir: str | Path,
                          commands: Sequence[str] = ()) -> PlotResult:
    """W5 speedup over plain decoding against batch size, one line per method × kind (one
    panel per target quantization when there are several); a hollow marker where no
    speculative step ran (the switch kept it off)."""
    name = "speedup_vs_batch"
    w5 = [r for r in records if r.workload == "W5" and r.metric == "speedup"]
    if not w5:
        return _skip(name, "no W5 records with metric speedup")
    many_models = len({r.model for r in w5}) > 1
    panels = _panels(w5)
    series: dict[tuple[str | None, str], list[tuple[float, float, bool]]] = {}
    dropped = []
    for r, row in zip(w5, assign_rows(w5, commands)):
        panel = next(p for p in panels if _in_panel(r, p))
        label = _drop_quant(row.series_label(drop_point=True), panel)
        if many_models:
            label = f"{r.model} · {label}"
        batch = r.config.get("batch")
        if not is_number(batch) or batch <= 0:
            dropped.append(f"{label} (batch {batch!r})")
            continue
        series.setdefault((panel, label), []).append((float(batch), r.value,
                                                      _spec_steps(r.config) != 0))
    if not series:
        return _skip(name, "no W5 speedup record has a numeric config.batch")
    multi = len(panels) > 1
    fig, axes = _figure(ncols=len(panels), width=4.6 if multi else
                        (7.2 if len(series) <= 10 else 10.0), height=4.6)
    # one colour per line label, the same in every panel
    labels = sorted({lab for _, lab in series}, key=natural_key)
    colors = {lab: (f"C{i % 10}", "-" if i < 10 else "--") for i, lab in enumerate(labels)}
    notes: list[str] = []
    batches = [p[0] for pts in series.values() for p in pts]
    for ax, panel in zip(axes, panels):
        mine = sorted(((lab, pts) for (p, lab), pts in series.items() if p == panel),
                      key=lambda kv: natural_key(kv[0]))
        for label, pts in mine:
            pts.sort()
            color, style = colors[label]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                    linestyle=style, label=label)
            off = [p for p in pts if not p[2]]
            if off:  # no speculative step ran at these batch sizes
                ax.scatter([p[0] for p in off], [p[1] for p in off], s=70,
                           facecolors="white", edgecolors=color, zorder=3)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        _log_x(ax, batches)
        ax.set_xlabel("batch size (concurrent requests), log scale")
        ax.grid(alpha=0.3)
        if multi:
            ax.set_title(f"target {panel}", fontsize=10)
        notes += _legend(ax, len(mine), small=multi)
    if multi:  # one y scale, so panels compare at a glance
        lo = min(ax.get_ylim()[0] for ax in axes)
        hi = max(ax.get_ylim()[1] for ax in axes)
        for ax in axes:
            ax.set_ylim(lo, hi)
    axes[0].set_ylabel("speedup over plain decoding")
    title = f"W5 speculative decoding speedup ({_devices(w5)})"
    (fig.suptitle if multi else axes[0].set_title)(title)
    return PlotResult(name, TITLES[name], _save(fig, out_dir, name),
                      caption="W5 `speedup` (speculative / plain output tok/s) by batch size, "
                              "one line per method × prompt kind"
                              + ("; one panel per target quantization" if multi else "")
                              + "; hollow: no speculative step ran (switched off); grey "
                              "line: 1.0.",
                      notes=[f"no numeric batch: {d}" for d in dropped] + notes)
