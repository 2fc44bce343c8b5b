"""`llmaccel report RUN...`: merge benchmark result files (docs/workloads.md's JSON lines) into one
markdown report: a header naming the inputs (devices, commits, the commands that made them),
one table per (workload, model) with ratios computed from the records, and PNG plots beside it
(`plots.py`).

Rows: W3 `backend [variant] @ load point`; W5 `method · kind · batch N`; otherwise
`backend [variant, quantization]`. Where that would still put two measurements of one metric in
one cell (two head vocabularies, two runs of the same setup), the row also names the config
keys (or the run) that tell them apart, chosen from the records: no value is silently dropped.

Ratios follow docs/workloads.md's protocol (a claim is a ratio measured side by side in one run on
one GPU): two rows are compared only when all their records come from one result file.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmaccel.bench.results import OURS, PREFIX_OFF, PREFIX_ON, Record, roofline_notes
from llmaccel.errors import LLMAccelError

logger = logging.getLogger(__name__)

RECORD_KEYS = tuple(Record.__dataclass_fields__)
REQUESTS_SUFFIX = ".requests.jsonl"
PROBLEMS_SUFFIX = ".problems.jsonl"

# Metrics a ratio is shown for. gbps and pct_roofline are tok_s times a constant of the shape
# (their ratios would repeat tok_s's); means and p95s would repeat the p50/p99 story.
HIGHER_IS_BETTER = ("tok_s", "decode_tok_s", "out_tok_s", "total_tok_s", "request_throughput",
                    "goodput", "pass_at_1")
LOWER_IS_BETTER = ("ttft_ms_p50", "ttft_ms_p95", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
                   "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "ppl",
                   "usd_per_m_out_tok")
LATENCY_METRIC = re.compile(r"^(ttft|tpot|itl|e2e)_ms_")
WIDE_TABLE = 10          # more metric columns than this: latencies get a table of their own
BASE_VARIANTS = (None, "base", "bf16")
BASE_QUANTIZATIONS = (None, "bf16")
# Config keys already in a row's label, by row style: never chosen again to tell rows apart.
LABEL_KEYS = {"plain": {"variant", "quantization"},
              "serving": {"variant", "quantization", "request_rate", "max_concurrency", "load"},
              "spec": {"variant", "quantization", "method", "kind", "batch"}}
TOP_LEVEL_KEYS = ("device", "load_format")  # the run (its command) is tried first
MAX_EXTRA_KEYS = 4
TITLES = {
    "throughput_vs_load": "Throughput vs load (W3)",
    "ttft_vs_load": "TTFT vs load (W3)",
    # the plot names the workloads its rows came from; this title is for when there are none
    "latency_cdf": "Per-request latency CDFs",
    "ppl_vs_tok_s": "Perplexity vs tok/s by quantization format (W6 × W1)",
    "acceptance_by_position": "Acceptance by draft position (W5)",
    "speedup_vs_batch": "Speedup vs batch (W5)",
}


@dataclass
class PlotResult:
    """One plot: the PNG written, or None and the reason it was skipped."""
    name: str                      # file stem of the PNG
    title: str
    path: Path | None
    reason: str = ""
    caption: str = ""
    notes: list[str] = field(default_factory=list)


# -- loading -----------------------------------------------------------------------------------
def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _identity(r: Record) -> tuple[str, ...]:
    return (r.workload, r.model, r.backend, json.dumps(r.config, sort_keys=True, default=str),
            r.metric)


def parse_record_line(line: str, where: str) -> tuple[Record, list[Record]]:
    """One result line -> (its record, records made from numeric top-level keys beyond the
    format, e.g. W5's "acceptance_rate"). Other unknown keys are ignored. `where` is
    "file:line" for the error message."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise LLMAccelError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(d, dict):
        raise LLMAccelError(f"{where}: expected a JSON object (a result record), "
                            f"got {type(d).__name__}")
    missing = [k for k in RECORD_KEYS if k not in d]
    if missing:
        raise LLMAccelError(f"{where}: not a result record, missing key(s) "
                            f"{', '.join(missing)}")
    if not isinstance(d["config"], dict):
        raise LLMAccelError(f"{where}: \"config\" must be a JSON object, "
                            f"got {type(d['config']).__name__}")
    if not is_number(d["value"]):
        raise LLMAccelError(f"{where}: \"value\" must be a number, got {d['value']!r}")
    fields = {k: (d[k] if k in ("config", "value") else str(d[k])) for k in RECORD_KEYS}
    record = Record(**fields)
    extras = [replace(record, config=dict(record.config), metric=k, value=v)
              for k, v in d.items() if k not in RECORD_KEYS and is_number(v)]
    return record, extras


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise LLMAccelError(f"{path}: not a UTF-8 text file ({e.reason})") from None
    except OSError as e:
        raise LLMAccelError(f"{path}: cannot read ({e.strerror or e})") from None


def read_results(path: str | Path) -> list[Record]:
    """Every record of one result file, strictly: a bad line raises `LLMAccelError` naming the
    file and line. Numeric top-level extras become records of their own unless the file has
    that record already."""
    path = Path(path)
    records: list[Record] = []
    extras: list[Record] = []
    for i, line in enumerate(_read_lines(path), 1):
        if line.strip():
            record, more = parse_record_line(line, f"{path}:{i}")
            records.append(record)
            extras += more
    seen = {_identity(r) for r in records}
    for r in extras:
        if _identity(r) not in seen:
            seen.add(_identity(r))
            records.append(r)
    return records


def read_requests(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a `.requests.jsonl` sidecar (one request each); a bad line raises naming it."""
    path = Path(path)
    rows = []
    for i, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LLMAccelError(f"{path}:{i}: not valid JSON ({e.msg}, column {e.colno})"
                                ) from None
        if not isinstance(row, dict):
            raise LLMAccelError(f"{path}:{i}: expected a JSON object (one request)")
        missing = [k for k in ("backend", "success") if k not in row]
        if missing:
            raise LLMAccelError(f"{path}:{i}: not a request row, missing key(s) "
                                f"{', '.join(missing)}")
        rows.append(row)
    return rows


def sidecar_path(result: str | Path) -> Path:
    """`<stem>.requests.jsonl` beside a result file."""
    result = Path(result)
    stem = result.name[:-len(".jsonl")] if result.name.endswith(".jsonl") else result.stem
    return result.with_name(stem + REQUESTS_SUFFIX)


def _looks_like_results(path: Path) -> bool:
    """False for JSON-lines files in a results directory that hold something else (e.g. a
    monitor trace): the first line is an object with neither "workload" nor "metric"."""
    for line in _read_lines(path):
        if line.strip():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                return True  # let the strict reader name the line
            return not (isinstance(d, dict) and "workload" not in d and "metric" not in d)
    return True


@dataclass
class RunFile:
    """One result file, its records, and its per-request sidecar if there is one."""
    path: Path
    records: list[Record]
    sidecar: Path | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def workloads(self) -> list[str]:
        return list(dict.fromkeys(r.workload for r in self.records))


def tag_workloads(rows: Iterable[dict[str, Any]], workloads: Sequence[str]) -> None:
    """Give sidecar rows that name no workload the one of the result file they sit beside
    (in memory only; the file is not rewritten). A file of several workloads cannot say which
    row is whose: those rows stay without one, and the report says it was not recorded."""
    if len(workloads) == 1:
        for row in rows:
            if not row.get("workload"):
                row["workload"] = workloads[0]


@dataclass
class ResultSet:
    files: list[RunFile]
    sidecars: list[tuple[Path, list[dict[str, Any]]]] = field(default_factory=list)  # named
    notes: list[str] = field(default_factory=list)

    @property
    def records(self) -> list[Record]:
        return [r for f in self.files for r in f.records]

    @property
    def requests(self) -> list[dict[str, Any]]:
        rows = [row for f in self.files for row in f.requests]
        return rows + [row for _, more in self.sidecars for row in more]

    @property
    def commands(self) -> list[str]:
        """Distinct commands in order of appearance: "run N" in row labels is entry N - 1."""
        return list(dict.fromkeys(r.command for r in self.records))

    def source_of(self) -> Callable[[Record], str]:
        by_id = {id(r): str(f.path) for f in self.files for r in f.records}
        return lambda r: by_id.get(id(r), "?")

    @property
    def missing_sidecars(self) -> list[Path]:
        """Expected sidecars that were not read, neither beside their file nor named. Only W3
        files must have one (`llmaccel bench serve`, their only writer, always writes it);
        other workloads' records also come from runs that write none (engine runs, benchmark
        scripts), so a sidecar's absence beside them says nothing."""
        named = {p.resolve() for p, _ in self.sidecars}
        return [sidecar_path(f.path) for f in self.files
                if f.sidecar is None and "W3" in f.workloads
                and sidecar_path(f.path).resolve() not in named]


def load_runs(runs: Sequence[str | Path]) -> ResultSet:
    """RUN arguments -> records. A directory means its `*.jsonl` files, except sidecars
    (`*.requests.jsonl`, `*.problems.jsonl`) and files that are not result files at all; a
    named file is read strictly. Missing paths, bad lines and no records at all raise."""
    if not runs:
        raise LLMAccelError("no result files given")
    files: list[Path] = []
    named_sidecars: list[Path] = []
    notes: list[str] = []
    named: set[Path] = set()  # read strictly; files found in a directory may be skipped
    for run in runs:
        p = Path(run)
        if p.is_dir():
            found = sorted(q for q in p.glob("*.jsonl") if q.is_file()
                           and not q.name.endswith((REQUESTS_SUFFIX, PROBLEMS_SUFFIX)))
            if not found:
                raise LLMAccelError(f"{p}: no *.jsonl result files in this directory")
            files += found
        elif p.is_file():
            if p.name.endswith(REQUESTS_SUFFIX):
                named_sidecars.append(p)
            elif p.name.endswith(PROBLEMS_SUFFIX):
                notes.append(f"{p}: a problems file, not results: not read")
            else:
                files.append(p)
                named.add(p.resolve())
        else:
            raise LLMAccelError(f"{run}: no such file or directory")
    out = ResultSet(files=[], notes=notes)
    seen: set[Path] = set()
    for p in files:
        key = p.resolve()
        if key in seen:
            continue
        seen.add(key)
        if key not in named and not _looks_like_results(p):
            out.notes.append(f"{p}: not result records (first line has no workload or metric)"
                             ": skipped")
            continue
        run_file = RunFile(p, read_results(p))
        if not run_file.records:
            out.notes.append(f"{p}: no records")
        side = sidecar_path(p)
        if side.is_file() and side.resolve() not in {s.resolve() for s in named_sidecars}:
            run_file.sidecar, run_file.requests = side, read_requests(side)
            tag_workloads(run_file.requests, run_file.workloads)
        out.files.append(run_file)
    beside = {sidecar_path(f.path).resolve(): f.workloads for f in out.files}
    for s in dict.fromkeys(named_sidecars):
        rows = read_requests(s)
        tag_workloads(rows, beside.get(s.resolve(), []))  # named, yet beside a file read
        out.sidecars.append((s, rows))
    if not any(f.records for f in out.files):
        raise LLMAccelError("no result records in " + ", ".join(str(r) for r in runs))
    return out


# -- rows --------------------------------------------------------------------------------------
def num_text(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def _is_inf(v: Any) -> bool:
    return (isinstance(v, str) and v.strip().lower() in ("inf", "infinity")) or (
        is_number(v) and math.isinf(v))


def load_point(config: Mapping[str, Any]) -> str:
    """A W3 load point as the suites label it (and as the sidecars' "load" says): "rate=4",
    "concurrency=8", "rate=4,concurrency=8", "all-at-once"."""
    if isinstance(config.get("load"), str) and config["load"]:
        return config["load"]
    rate, conc = config.get("request_rate"), config.get("max_concurrency")
    parts = []
    if rate is not None and not _is_inf(rate):
        parts.append(f"rate={num_text(rate)}")
    if conc is not None:
        parts.append(f"concurrency={num_text(conc)}")
    return ",".join(parts) or "all-at-once"


def load_x(config: Mapping[str, Any]) -> tuple[str, float] | None:
    """Where a W3 load point goes on a load axis: ("concurrency", n) when capped, else
    ("request rate", r) for a finite rate; None for all-at-once without a cap."""
    conc, rate = config.get("max_concurrency"), config.get("request_rate")
    if is_number(conc):
        return "concurrency", float(conc)
    if is_number(rate) and math.isfinite(rate):
        return "request rate", float(rate)
    if isinstance(rate, str):
        try:
            value = float(rate)
        except ValueError:
            return None
        return ("request rate", value) if math.isfinite(value) else None
    return None


@dataclass(frozen=True)
class RowId:
    """A table row. Rows with equal `slot()` and different backends are comparable."""
    style: str                       # "serving" (W3), "spec" (W5) or "plain"
    backend: str
    variant: str | None = None
    quantization: str | None = None
    point: tuple[str, ...] = ()      # W3: (load,); W5: (method, kind, batch)
    extra: tuple[tuple[str, str], ...] = ()  # (key, value) telling otherwise equal rows apart

    def slot(self) -> tuple[Any, ...]:
        return self.variant, self.quantization, self.point, self.extra

    def brackets(self) -> list[str]:
        out = [self.variant] if self.variant else []
        if self.quantization and self.quantization != self.variant:
            out.append(self.quantization)
        return out

    def series_label(self, drop_point: bool = False) -> str:
        """The label; with drop_point, without the load (W3) or batch (W5): a plot line."""
        b = f" [{', '.join(self.brackets())}]" if self.brackets() else ""
        if self.style == "spec":
            point = self.point[:2] if drop_point else self.point
            parts = [point[0], point[1], *(f"batch {p}" for p in point[2:])]
            text = " · ".join(parts) + b + (f" ({self.backend})" if self.backend != OURS else "")
        elif self.style == "serving" and not drop_point:
            text = f"{self.backend}{b} @ {self.point[0]}"
        else:
            text = f"{self.backend}{b}"
        shown = [{"run": f"run {v}", "#": f"#{v}"}.get(k, f"{k}={v}") for k, v in self.extra
                 if v not in ("None", "")]
        return " · ".join([text, *shown])

    @property
    def label(self) -> str:
        return self.series_label()


def base_row(r: Record) -> RowId:
    c = r.config
    variant = str(c["variant"]) if c.get("variant") not in (None, "") else None
    quant = str(c["quantization"]) if c.get("quantization") not in (None, "") else None
    if r.workload == "W3":
        return RowId("serving", r.backend, variant, quant, (load_point(c),))
    if r.workload == "W5" and "method" in c:  # (W5 step-cost records have no method)
        point = (str(c["method"]), str(c.get("kind", "?")), num_text(c.get("batch", "?")))
        if variant == f"{point[0]} {point[1]} b{point[2]}":
            variant = None  # `bench spec`'s own row name: the point again, batch included
        return RowId("spec", r.backend, variant, quant, point)
    return RowId("plain", r.backend, variant, quant)


def _scalar(v: Any) -> str | None:
    """A config value usable to tell rows apart: a category, not a measurement. Lists, dicts
    and fractional floats (timings, rates) are not."""
    if v is None or isinstance(v, (str, bool, int)):
        return str(v)
    if isinstance(v, float) and v.is_integer():
        return num_text(v)
    return None


def _key_value(r: Record, key: str, commands: Mapping[str, int]) -> str | None:
    if key == "run":
        return str(commands.get(r.command, "?"))
    if key.startswith("@"):
        return str(getattr(r, key[1:]))
    return _scalar(r.config.get(key))


def _cell_collisions(records: Sequence[Record], rows: Sequence[Any]) -> int:
    """How many records would land in a (row, metric) cell that already holds a value."""
    cells = Counter((row, r.metric) for r, row in zip(records, rows))
    return sum(n - 1 for n in cells.values())


def _row_extras(records: Sequence[Record], bases: Sequence[RowId],
                commands: Mapping[str, int]) -> list[tuple[tuple[str, str], ...]]:
    """What tells apart records of one (workload, model) that share a base row and metric.
    First the run, for every row, if the group mixes runs that collide. Then, per cluster of
    rows still colliding, greedily the key leaving the fewest collisions; ties go to keys
    with fewer distinct values over the whole group (a category such as a vocabulary size,
    not a counter of steps), then by name. Only scalar values count (not timings)."""
    n = len(records)
    extras: list[tuple[tuple[str, str], ...]] = [()] * n
    if _cell_collisions(records, bases) == 0:
        return extras
    run_values = [str(commands.get(r.command, "?")) for r in records]
    if len(set(run_values)) > 1 and (_cell_collisions(records, list(zip(bases, run_values)))
                                     < _cell_collisions(records, bases)):
        extras = [(("run", v),) for v in run_values]
    in_label = set().union(*(LABEL_KEYS[b.style] for b in bases))
    names = [*(f"@{k}" for k in TOP_LEVEL_KEYS),
             *dict.fromkeys(k for r in records for k in r.config if k not in in_label)]
    distinct = {k: len({_key_value(r, k, commands) for r in records}) for k in names}
    clusters: dict[Any, list[int]] = {}
    for i in range(n):
        clusters.setdefault((bases[i], extras[i]), []).append(i)
    for idxs in clusters.values():
        recs = [records[i] for i in idxs]
        rows: list[tuple[Any, ...]] = [() for _ in idxs]
        left = _cell_collisions(recs, rows)
        chosen: list[str] = []
        candidates = [k for k in names
                      if None not in (vals := [_key_value(r, k, commands) for r in recs])
                      and len(set(vals)) > 1]
        while left and candidates and len(chosen) < MAX_EXTRA_KEYS:
            def score(k: str) -> tuple[int, int, str]:
                keyed = [(*row, _key_value(r, k, commands)) for r, row in zip(recs, rows)]
                return _cell_collisions(recs, keyed), distinct[k], k
            best = min(candidates, key=score)
            if score(best)[0] >= left:
                break
            chosen.append(best)
            candidates.remove(best)
            rows = [(*row, _key_value(r, best, commands)) for r, row in zip(recs, rows)]
            left = _cell_collisions(recs, rows)
        for i, r in zip(idxs, recs):
            extras[i] += tuple((k.lstrip("@"), _key_value(r, k, commands) or "")
                               for k in chosen)
    return extras


def assign_rows(records: Sequence[Record], commands: Sequence[str] = ()) -> list[RowId]:
    """The row of each record (same order). Within each (workload, model), rows that would
    merge different measurements of one metric get distinguishing keys; any still merged are
    numbered (#2, #3...). `commands` numbers runs for "run N" (default: order of appearance)."""
    numbers = {c: i + 1 for i, c in enumerate(dict.fromkeys([*commands,
                                                              *(r.command for r in records)]))}
    bases = [base_row(r) for r in records]
    out = list(bases)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault((r.workload, r.model), []).append(i)
    for idxs in groups.values():
        recs = [records[i] for i in idxs]
        extras = _row_extras(recs, [bases[i] for i in idxs], numbers)
        seen: Counter[tuple[RowId, str]] = Counter()
        for i, r, extra in zip(idxs, recs, extras):
            row = replace(bases[i], extra=extra)
            seen[row, r.metric] += 1
            if seen[row, r.metric] > 1:  # nothing in the records tells them apart
                row = replace(row, extra=(*extra, ("#", str(seen[row, r.metric]))))
            out[i] = row
    return out


# -- tables ------------------------------------------------------------------------------------
def fmt_value(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.4g}"


def natural_key(text: str) -> tuple[Any, ...]:
    """"rate=16" after "rate=4"; "inf" last."""
    parts: list[Any] = []
    for tok in re.split(r"(\d+(?:\.\d+)?|inf)", text):
        if not tok:
            continue
        try:
            parts.append((0, float(tok), ""))
        except ValueError:
            parts.append((1, 0.0, tok))
    return tuple(parts)


def _load_order(load: str) -> tuple[Any, ...]:
    """Rate sweeps, then concurrency sweeps, each in numeric order; all-at-once last."""
    parts = dict(p.split("=", 1) for p in load.split(",") if "=" in p)

    def num(text: str | None) -> float:
        try:
            return float(text) if text is not None else math.inf
        except ValueError:
            return math.inf
    if "concurrency" in parts:
        return 1, num(parts["concurrency"]), num(parts.get("rate")), load
    if "rate" in parts:
        return 0, num(parts["rate"]), 0.0, load
    return 2, 0.0, 0.0, load


@dataclass
class Table:
    """One (workload, model) group: rows in display order, metric columns, cells."""
    workload: str
    model: str
    rows: list[RowId]
    metrics: list[str]
    cells: dict[RowId, dict[str, float]]
    sources: dict[RowId, set[str]]
    devices: dict[RowId, set[str]]

    @property
    def style(self) -> str:
        return self.rows[0].style if self.rows else "plain"


def build_tables(records: Sequence[Record], rows: Sequence[RowId],
                 source_of: Callable[[Record], str] = lambda r: "?") -> list[Table]:
    tables: dict[tuple[str, str], Table] = {}
    first_seen: dict[Any, int] = {}
    for r, row in zip(records, rows):
        t = tables.setdefault((r.workload, r.model),
                              Table(r.workload, r.model, [], [], {}, {}, {}))
        if row not in t.cells:
            t.rows.append(row)
            t.cells[row], t.sources[row], t.devices[row] = {}, set(), set()
        if r.metric not in t.metrics:
            t.metrics.append(r.metric)
        t.cells[row][r.metric] = r.value
        t.sources[row].add(source_of(r))
        t.devices[row].add(r.device)
        head = row.point[0] if row.style == "spec" else row.backend
        first_seen.setdefault((head, tuple(row.brackets())), len(first_seen))
    for t in tables.values():
        if t.style in ("serving", "spec"):  # a line's load points or batches together, in order
            def key(row: RowId) -> tuple[Any, ...]:
                head = row.point[0] if row.style == "spec" else row.backend
                last = (_load_order(row.point[-1]) if row.style == "serving"
                        else natural_key(row.point[-1]))
                return (first_seen[head, tuple(row.brackets())],
                        *(natural_key(p) for p in row.point[:-1]), natural_key(str(row.extra)),
                        last)
            t.rows.sort(key=key)
    return list(tables.values())


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def table_markdown(t: Table) -> list[str]:
    """The table; a wide one (serving) splits its latency percentiles into a second table."""
    title = {"serving": "backend @ load", "spec": "method · kind · batch"}.get(t.style,
                                                                             "backend")
    groups = [t.metrics]
    latency = [m for m in t.metrics if LATENCY_METRIC.match(m)]
    if len(t.metrics) > WIDE_TABLE and latency and len(latency) < len(t.metrics):
        groups = [[m for m in t.metrics if m not in latency], latency]
    out: list[str] = []
    for metrics in groups:
        out.append(f"| {title} | " + " | ".join(metrics) + " |")
        out.append("|---|" + "---:|" * len(metrics))
        for row in t.rows:
            vals = t.cells[row]
            cells = [fmt_value(vals[m]) if m in vals else "–" for m in metrics]
            out.append(f"| {_escape(row.label)} | " + " | ".join(cells) + " |")
        out.append("")
    return out


@dataclass
class Comparison:
    first: RowId
    second: RowId
    ratios: dict[str, float]   # metric -> ratio, > 1: the first row is better


def _fmt_of(row: RowId) -> str:
    return row.quantization or "bf16"  # no quantization named: the unquantized model


def _is_base(row: RowId) -> bool:
    return row.variant in BASE_VARIANTS and row.quantization in BASE_QUANTIZATIONS


def comparisons(t: Table) -> tuple[list[Comparison], list[str]]:
    """Ratios of one table: llmaccel against every other backend at the same slot (load
    point, variant...); each variant or quantization against the base row of its backend;
    prefix cache on against off. Only rows of one result file on one device are compared
    (docs/workloads.md: a claim is a ratio measured side by side in one run). Returns the
    comparisons and the pairs left out for coming from different runs."""
    def one_run(a: RowId, b: RowId) -> bool:
        return len(t.sources[a] | t.sources[b]) == 1 and len(t.devices[a] | t.devices[b]) == 1

    pairs: list[tuple[RowId, RowId]] = []
    skipped: list[str] = []
    for row in t.rows:
        if row.backend == OURS:
            continue
        # ours at the same point and format; of its variants the same one if there is one,
        # else each (a baseline has no "async scheduling" or "spec-ngram" variant)
        ours = [a for a in t.rows if a.backend == OURS and a.point == row.point
                and a.extra == row.extra and _fmt_of(a) == _fmt_of(row)]
        ours = [a for a in ours if a.variant == row.variant] or ours
        same = [a for a in ours if one_run(a, row)]
        pairs += [(a, row) for a in same]
        if ours and not same:
            skipped.append(f"{ours[0].label} vs {row.label}")
    if t.style != "spec":  # W5's speedup is already a ratio to plain decoding
        for row in t.rows:
            same = [b for b in t.rows if b != row and b.backend == row.backend
                    and b.point == row.point and b.extra == row.extra and one_run(b, row)]
            if row.variant == PREFIX_ON:
                bases = [b for b in same if b.variant == PREFIX_OFF
                         and b.quantization == row.quantization]
            elif not _is_base(row):
                bases = [b for b in same if _is_base(b)]
            else:
                continue
            if len(bases) == 1:
                pairs.append((row, bases[0]))
    out = []
    for a, b in pairs:
        ratios = {}
        for m in t.metrics:
            va, vb = t.cells[a].get(m), t.cells[b].get(m)
            if not va or not vb:
                continue
            if m in HIGHER_IS_BETTER:
                ratios[m] = va / vb
            elif m in LOWER_IS_BETTER:
                ratios[m] = vb / va
        if ratios:
            out.append(Comparison(a, b, ratios))
    return out, skipped


def fmt_ratio(metric: str, ratio: float) -> str:
    """Two decimals ("2.00×"); three for perplexity, whose differences are small."""
    return f"{ratio:.3f}×" if metric == "ppl" else f"{ratio:.2f}×"


def ratio_markdown(comps: Sequence[Comparison]) -> list[str]:
    if not comps:
        return []
    metrics = list(dict.fromkeys(m for c in comps for m in c.ratios))
    heads = [f"{m} ↓" if m in LOWER_IS_BETTER else m for m in metrics]
    out = ["Ratios, computed from the records above: > 1 means the first row is better "
           "(first / second; for ↓ metrics, lower is better: second / first).", "",
           "| comparison | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(metrics)]
    for c in comps:
        cells = [fmt_ratio(m, c.ratios[m]) if m in c.ratios else "–" for m in metrics]
        out.append(f"| {_escape(c.first.label)} vs {_escape(c.second.label)} | "
                   + " | ".join(cells) + " |")
    return out + [""]


# -- the W6 x W1 join (perplexity against speed per format) -----------------------------------
def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """Names of the points (speed, ppl) that no other point dominates (at least as fast and
    at most as perplexed, better in one), by speed ascending."""
    front = [name for name, (s, p) in points.items()
             if not any(s2 >= s and p2 <= p and (s2 > s or p2 < p)
                        for other, (s2, p2) in points.items() if other != name)]
    return sorted(front, key=lambda n: (points[n][0], -points[n][1], n))


@dataclass
class PplSpeedJoin:
    """W6 perplexity and W1 tok/s per quantization format, for one (ppl model, speed model,
    speed device). Each side keeps the best value of its candidates per format."""
    ppl_model: str
    speed_model: str
    speed_device: str
    points: dict[str, tuple[float, float]]         # format -> (tok_s, ppl)
    ppl_only: list[str]
    speed_only: list[str]
    candidates: dict[str, tuple[int, int]]         # format -> (# tok_s, # ppl records)
    not_used: list[str]                            # other models/devices on either side


def _format_of(r: Record, reference: str | None = None) -> str | None:
    """A record's quantization format; a variant that is not the format itself (e.g. a LoRA
    merge) is a different model, not a format, unless it is `reference`: the unquantized
    variant the formats were made from (a recipe's fine-tuned model, or its base)."""
    q, v = r.config.get("quantization"), r.config.get("variant")
    if not isinstance(q, str) or not q:
        return None
    return q if v in (None, "", q) or (reference is not None and v == reference) else None


def join_ppl_speed(records: Iterable[Record],
                   reference: str | None = None) -> PplSpeedJoin | None:
    """The (W6 model, W1 model and device) pair sharing the most formats; None if no W6 ppl or
    no W1 tok_s record names a quantization. `reference`: see _format_of."""
    ppl: dict[str, dict[str, list[float]]] = {}
    speed: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in records:
        fmt = _format_of(r, reference)
        if fmt is None:
            continue
        if r.workload == "W6" and r.metric == "ppl":
            ppl.setdefault(r.model, {}).setdefault(fmt, []).append(r.value)
        elif r.workload == "W1" and r.metric == "tok_s":
            speed.setdefault((r.model, r.device), {}).setdefault(fmt, []).append(r.value)
    if not ppl or not speed:
        return None
    order = {k: i for i, k in enumerate([*ppl, *speed])}
    pm, sk = max(((pm, sk) for pm in ppl for sk in speed),
                 key=lambda ps: (len(ppl[ps[0]].keys() & speed[ps[1]].keys()),
                                 len(ppl[ps[0]]), -order[ps[0]], -order[ps[1]]))
    p, s = ppl[pm], speed[sk]
    common = [f for f in s if f in p]
    return PplSpeedJoin(
        ppl_model=pm, speed_model=sk[0], speed_device=sk[1],
        points={f: (max(s[f]), min(p[f])) for f in common},
        ppl_only=[f for f in p if f not in s], speed_only=[f for f in s if f not in p],
        candidates={f: (len(s[f]), len(p[f])) for f in common},
        not_used=[f"W6 {m} ({len(v)} formats)" for m, v in ppl.items() if m != pm]
        + [f"W1 {m} on {d} ({len(v)} formats)" for (m, d), v in speed.items() if (m, d) != sk])


# -- the report --------------------------------------------------------------------------------
def _code(text: str) -> str:
    ticks = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def header_markdown(rs: ResultSet, title: str) -> list[str]:
    records = rs.records
    commands = {c: i + 1 for i, c in enumerate(rs.commands)}
    out = [f"# {title}", "",
           f"{len(records)} records from {len(rs.files)} result file(s).", "",
           "| file | records | workloads | device | torch | commit | run |",
           "|---|---:|---|---|---|---|---|"]
    for f in rs.files:
        rec = f.records
        cells = [", ".join(dict.fromkeys(getattr(r, k) for r in rec))
                 for k in ("workload", "device", "torch", "commit")]
        runs = ", ".join(str(commands[c]) for c in dict.fromkeys(r.command for r in rec))
        out.append(f"| {_escape(str(f.path))} | {len(rec)} | "
                   + " | ".join(_escape(c) for c in cells) + f" | {runs} |")
    out += ["", "Runs (the commands that made the records):", ""]
    out += [f"{i}. {_code(' '.join(c.split()))}" for c, i in commands.items()]  # one line
    devices = list(dict.fromkeys(r.device for r in records))
    out += ["", f"Devices: {', '.join(devices)}."]
    if len(devices) > 1:
        out.append("Absolute numbers hold only for their device.")
    out.append("Ratios compare rows of one result file only (one run on one GPU).")
    sidecars = [(f.sidecar, f.requests) for f in rs.files if f.sidecar] + rs.sidecars
    if sidecars:
        out += ["", "Per-request sidecars:", ""]
        for path, rows in sidecars:
            failed = sum(1 for row in rows if not row.get("success"))
            out.append(f"- {path}: {len(rows)} requests, {failed} failed")
    if rs.notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in rs.notes]
    return out + [""]


def plot_markdown(plots: Sequence[PlotResult]) -> list[str]:
    out = ["## Plots", ""]
    for p in plots:
        out += [f"### {p.title}", ""]
        if p.path is None:
            out += [f"Skipped: {p.reason}", ""]
            continue
        out += [f"![{p.title}]({p.path.name})", ""]
        if p.caption:
            out += [p.caption, ""]
        if p.notes:
            out += [f"- {n}" for n in p.notes] + [""]
    return out


def make_plots(rs: ResultSet, out_dir: Path,
               reference_variant: str | None = None) -> list[PlotResult]:
    """Every plot of plots.py; one that fails is reported as skipped (the tables still get
    written), and without matplotlib all are. `reference_variant`: the unquantized variant
    the quantization formats were made from (the bf16 point of perplexity vs speed)."""
    try:
        from llmaccel.bench import plots
    except ImportError as e:
        reason = f"matplotlib is not installed ({e}); pip install 'llmaccel[report]'"
        return [PlotResult(name, title, None, reason) for name, title in TITLES.items()]
    records, commands = rs.records, rs.commands
    missing = [str(p) for p in rs.missing_sidecars]
    jobs: list[tuple[str, Callable[[], Any]]] = [
        ("throughput_vs_load", lambda: plots.plot_throughput_vs_load(records, out_dir,
                                                                     commands)),
        ("ttft_vs_load", lambda: plots.plot_ttft_vs_load(records, out_dir, commands)),
        ("latency_cdf", lambda: plots.plot_latency_cdfs(rs.requests, out_dir, missing)),
        ("ppl_vs_tok_s", lambda: plots.plot_ppl_vs_speed(records, out_dir,
                                                         reference_variant)),
        ("acceptance_by_position", lambda: plots.plot_acceptance_by_position(
            records, out_dir, commands)),
        ("speedup_vs_batch", lambda: plots.plot_speedup_vs_batch(records, out_dir, commands)),
    ]
    results = []
    for name, job in jobs:
        try:
            result = job()
        except Exception as e:  # one broken plot must not cost the whole report
            logger.exception("plot %s failed", name)
            result = PlotResult(name, TITLES[name], None, f"failed: {type(e).__name__}: {e}")
        if result.path is None:  # no stale image of an earlier report beside this one
            (out_dir / f"{name}.png").unlink(missing_ok=True)
        results.append(result)
    return results


def render_markdown(rs: ResultSet, plots: Sequence[PlotResult], title: str) -> str:
    records = rs.records
    rows = assign_rows(records, rs.commands)
    labels = {id(r): row.label for r, row in zip(records, rows)}
    out = header_markdown(rs, title)
    for t in build_tables(records, rows, rs.source_of()):
        out += [f"## {t.workload} — {t.model}", ""]
        devices = sorted(set().union(*t.devices.values()))
        files = sorted(set().union(*t.sources.values()))
        out += [f"Device: {', '.join(devices)}. From: {', '.join(files)}.", ""]
        out += table_markdown(t)
        notes = roofline_notes((r for r in records if (r.workload, r.model)
                                == (t.workload, t.model)), lambda r: labels[id(r)])
        out += [f"- {n}" for n in notes] + ([""] if notes else [])
        comps, skipped = comparisons(t)
        out += ratio_markdown(comps)
        if skipped:
            out += [f"Not compared (rows from different result files or devices): "
                    f"{'; '.join(skipped)}.", ""]
    out += plot_markdown(plots)
    return "\n".join(out).rstrip() + "\n"


@dataclass
class ReportOutput:
    markdown: Path
    images: list[Path]
    skipped: list[PlotResult]   # plots without an image, each with its reason


def write_report(runs: Sequence[str | Path], out: str | Path = "report",
                 title: str = "llmaccel report",
                 reference_variant: str | None = None) -> ReportOutput:
    """Read RUN files/directories, write `out/report.md` and the PNGs it embeds
    (`reference_variant`: see make_plots)."""
    rs = load_runs(runs)
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LLMAccelError(f"{out_dir}: cannot create the output directory "
                            f"({e.strerror or e})") from None
    plots = make_plots(rs, out_dir, reference_variant)
    path = out_dir / "report.md"
    path.write_text(render_markdown(rs, plots, title), encoding="utf-8")
    return ReportOutput(path, [p.path for p in plots if p.path is not None],
                        [p for p in plots if p.path is None])
