"""Benchmark records in the format of docs/workloads.md: one JSON object a line, plus a markdown
summary whose ratios are computed from the records themselves (never typed in by hand)."""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmaccel import envs

logger = logging.getLogger(__name__)

OURS = "llmaccel"
# Metrics where more is better; a ratio reads "ours / theirs". Latencies are the reverse, so
# their ratio reads "theirs / ours" and stays a speed-up (> 1 means we are faster). gbps and
# pct_roofline are tok_s times a constant of the shape, so their ratios would repeat tok_s's.
HIGHER_IS_BETTER = ("tok_s", "decode_tok_s", "out_tok_s")
LOWER_IS_BETTER = ("ttft_ms_p50", "ttft_ms_p95", "ttft_ms_p99", "tpot_ms_p50", "e2e_ms_p50")
PREFIX_OFF, PREFIX_ON = "prefix-cache-off", "prefix-cache-on"


@dataclass(frozen=True)
class RunMeta:
    """What every record of one run shares: where and from what it was measured."""
    device: str
    torch: str
    commit: str
    command: str


@dataclass
class Record:
    """One measurement. Field order is the order of docs/workloads.md's example line."""
    workload: str
    model: str
    load_format: str
    backend: str
    config: dict[str, Any]
    metric: str
    value: float
    device: str
    torch: str
    commit: str
    command: str

    @property
    def label(self) -> str:
        """The backend, plus a variant (e.g. prefix cache on/off) if any."""
        variant = self.config.get("variant")
        return f"{self.backend} [{variant}]" if variant else self.backend

    @property
    def load(self) -> str:
        """The load point of a serving run ("rate=4", "concurrency=8"); "" elsewhere."""
        return str(self.config.get("load") or "")

    @property
    def row(self) -> str:
        """Table row label: `label`, and the load point where there is one (W3 has a row per
        backend and load point)."""
        return f"{self.label} @ {self.load}" if self.load else self.label

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Failure:
    """A backend that raised: logged and shown in the markdown, never written as a record."""
    workload: str
    model: str
    backend: str
    error: str


@dataclass
class Outcome:
    records: list[Record] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    def extend(self, other: Outcome) -> None:
        self.records += other.records
        self.failures += other.failures


def make_record(meta: RunMeta, workload: str, model: str, backend: str, config: dict[str, Any],
                metric: str, value: float, load_format: str = "dummy") -> Record:
    return Record(workload, model, load_format, backend, dict(config), metric,
                  round(float(value), 3), meta.device, meta.torch, meta.commit, meta.command)


def current_commit() -> str:
    """$LLMACCEL_COMMIT (copies of the tree without .git, as on the GPU machine), else git's
    HEAD, else "unknown"."""
    if envs.LLMACCEL_COMMIT:
        return envs.LLMACCEL_COMMIT
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parents[2], timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def guarded(fn: Callable[[], list[Record]], workload: str, model: str,
            backend: str) -> Outcome:
    """Run one (backend, workload): an exception becomes a Failure so the run goes on."""
    try:
        return Outcome(records=fn())
    except Exception as e:  # any failure of one backend must not end the run
        logger.exception("%s %s on %s failed", backend, workload, model)
        text = " ".join(str(e).split()) or type(e).__name__
        return Outcome(failures=[Failure(workload, model, backend,
                                         f"{type(e).__name__}: {text}"[:500])])


# -- JSON lines --------------------------------------------------------------------------------
def write_jsonl(path: str | Path, records: Iterable[Record]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(asdict(r)) + "\n" for r in records)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """One plain record appended as a JSON line (the benchmarks' own kinds of record, which
    accumulate over runs in one results file)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: str | Path) -> list[Record]:
    with open(path) as f:
        return [Record.from_dict(json.loads(line)) for line in f if line.strip()]


# -- markdown ----------------------------------------------------------------------------------
def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.4g}"


def _group(records: list[Record], failures: list[Failure]) -> dict[tuple[str, str], Outcome]:
    groups: dict[tuple[str, str], Outcome] = {}
    for r in records:
        groups.setdefault((r.workload, r.model), Outcome()).records.append(r)
    for f in failures:
        groups.setdefault((f.workload, f.model), Outcome()).failures.append(f)
    return groups


def _table(records: list[Record]) -> tuple[list[str], dict[str, dict[str, float]]]:
    metrics: list[str] = []
    values: dict[str, dict[str, float]] = {}
    for r in records:
        if r.metric not in metrics:
            metrics.append(r.metric)
        values.setdefault(r.row, {})[r.metric] = r.value
    return metrics, values


def ratio_lines(records: list[Record]) -> list[str]:
    """Speed ratios of one (workload, model) group: llmaccel against each other backend, and
    prefix cache off against on, each at one load point (rows at different loads are never
    divided). Each line names its metric and direction (and load)."""
    loads = list(dict.fromkeys(r.load for r in records))
    lines = []
    for load in loads:
        at = [r for r in records if r.load == load]
        lines += [f"at {load}: {line}" if load else line for line in _ratio_lines_at(at)]
    return lines


def _ratio_lines_at(records: list[Record]) -> list[str]:
    """ratio_lines for records of one load point (rows keyed by `label`)."""
    metrics: list[str] = []
    values: dict[str, dict[str, float]] = {}
    for r in records:
        if r.metric not in metrics:
            metrics.append(r.metric)
        values.setdefault(r.label, {})[r.metric] = r.value
    lines = []
    ours = values.get(OURS)
    for row, theirs in values.items():
        if ours is None or row == OURS:
            continue
        for m in metrics:
            if m not in ours or m not in theirs or not ours[m] or not theirs[m]:
                continue
            if m in HIGHER_IS_BETTER:
                lines.append(f"{OURS} / {row} ({m}) = {ours[m] / theirs[m]:.2f}×")
            elif m in LOWER_IS_BETTER:
                lines.append(f"{row} / {OURS} ({m}, lower is better) = "
                             f"{theirs[m] / ours[m]:.2f}×")
    for backend in dict.fromkeys(r.backend for r in records):
        off, on = values.get(f"{backend} [{PREFIX_OFF}]"), values.get(f"{backend} [{PREFIX_ON}]")
        if off is None or on is None:
            continue
        for m in metrics:
            if m in LOWER_IS_BETTER and off.get(m) and on.get(m):
                lines.append(f"{backend}: {PREFIX_OFF} / {PREFIX_ON} ({m}) = "
                             f"{off[m] / on[m]:.2f}×")
    return lines


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Device names as torch reports them -> their entry in llmaccel.analyze.GPU_BANDWIDTH_GBPS.
# Only names that pin down one memory configuration: an "A100 80GB PCIe" or an "RTX 3090 Ti"
# has other bandwidth than its namesake in that table, so it gets no datasheet figure.
DATASHEET_DEVICES = {
    "NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H200": "H200",
    "NVIDIA A100-SXM4-80GB": "A100-80GB", "NVIDIA A100-SXM4-40GB": "A100-40GB",
    "NVIDIA A100-PCIE-40GB": "A100-40GB", "NVIDIA L4": "L4", "Tesla T4": "T4",
    "NVIDIA GeForce RTX 3090": "RTX 3090",
}
# Why a percentage of the measured copy bandwidth can pass 100: the copy both reads and
# writes every byte, while decode mostly reads, and reads alone can stream faster.
OVER_COPY_REASON = ("the measured copy figure understates read bandwidth: decode mostly "
                    "reads, and it read faster than the read + write copy ran (on a CPU, caches "
                    "help too); the value is shown as recorded, not clamped")


def datasheet_bandwidth(device: str) -> tuple[str, float] | None:
    """(datasheet name, GB/s) of a device named as torch names it; None when unknown."""
    name = DATASHEET_DEVICES.get(device.strip())
    if name is None:
        return None
    from llmaccel.analyze import GPU_BANDWIDTH_GBPS  # imports transformers: only when needed

    gbps = GPU_BANDWIDTH_GBPS.get(name)
    return (name, gbps) if gbps else None


def roofline_notes(records: Iterable[Record],
                   label: Callable[[Record], str] = lambda r: r.row) -> list[str]:
    """What each pct_roofline record is a percent of, from its config: the measured copy
    bandwidth and the roofline arithmetic (one line per distinct arithmetic), the share of
    the datasheet bandwidth where the device has a known one, and why a value over 100 is
    possible wherever there is one. `label`: a record's row as its table shows it."""
    rows_by_note: dict[str, list[str]] = {}
    per_row: list[str] = []
    for r in records:
        c = r.config
        if r.metric != "pct_roofline":
            continue
        row = label(r)
        if not _is_number(c.get("copy_gbps")):
            note = "pct_roofline: the bandwidth it is a percent of is not recorded"
        else:
            note = (f"pct_roofline = % of measured copy bandwidth {c['copy_gbps']:,.4g} GB/s "
                    f"({c.get('copy_method', 'method not recorded')}), read + write, not a "
                    "datasheet figure")
            if _is_number(c.get("roofline_tok_s")) and _is_number(c.get("bytes_per_step")):
                note += (f"; roofline {c['roofline_tok_s']:,.0f} tok/s = that bandwidth / "
                         f"{c['bytes_per_step'] / 1e9:.4g} GB read per step (weights + KV)")
            note += f"; pct_roofline from {c.get('rate_basis', 'tok_s')}"
            sheet = datasheet_bandwidth(r.device)
            if sheet is not None:
                achieved = r.value / 100 * c["copy_gbps"]
                per_row.append(f"{row}: achieved {achieved:,.4g} GB/s = "
                               f"{100 * achieved / sheet[1]:.1f}% of the {sheet[0]} datasheet "
                               f"bandwidth {sheet[1]:,.0f} GB/s")
        rows_by_note.setdefault(note, []).append(row)
        if r.value > 100:
            per_row.append(f"{row}: pct_roofline {r.value:.4g} > 100: {OVER_COPY_REASON}")
    return [f"{', '.join(rows)}: {note}" for note, rows in rows_by_note.items()] + per_row


def summary_markdown(records: Iterable[Record], failures: Iterable[Failure] = (),
                     title: str = "GPU speed", header: Iterable[str] = ()) -> str:
    header = list(header)
    out = [f"# {title}", "", *header, ""] if header else [f"# {title}", ""]
    for (workload, model), group in _group(list(records), list(failures)).items():
        out += [f"## {workload} — {model}", ""]
        if group.records:
            metrics, values = _table(group.records)
            out.append("| backend | " + " | ".join(metrics) + " |")
            out.append("|---|" + "---|" * len(metrics))
            for row, vals in values.items():
                cells = [_fmt(vals[m]) if m in vals else "–" for m in metrics]
                out.append(f"| {row} | " + " | ".join(cells) + " |")
            out.append("")
            out += [f"- {line}" for line in ratio_lines(group.records)]
            out += [f"- {note}" for note in roofline_notes(group.records)]
        out += [f"- {f.backend}: {json.dumps({'error': f.error})}" for f in group.failures]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_markdown(path: str | Path, records: Iterable[Record],
                   failures: Iterable[Failure] = (),
                   title: str = "GPU speed", header: Iterable[str] = ()) -> None:
    Path(path).write_text(summary_markdown(records, failures, title, header))
