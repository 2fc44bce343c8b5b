"""`llmaccel report RUN...`: benchmark result files -> report.md (tables, ratios) + PNG plots.
Registered in cli.py as `app.command("report")(report)`."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console()

RUNS_HELP = ("Result files (docs/workloads.md JSON lines) or directories of them (every *.jsonl "
             "except *.requests.jsonl and *.problems.jsonl). A <stem>.requests.jsonl beside a "
             "file feeds the latency CDFs.")


def report(
    runs: list[str] = typer.Argument(..., metavar="RUN", help=RUNS_HELP),
    out: str = typer.Option("report", "--out", metavar="DIR",
                            help="Directory for report.md and the PNGs."),
    title: str = typer.Option("llmaccel report", "--title", help="The report's heading."),
) -> None:
    """Merge benchmark results into markdown tables (ratios computed from the records) and
    matplotlib plots: throughput and TTFT vs load, latency CDFs, perplexity vs tok/s,
    speculative acceptance and speedup."""
    from llmaccel.bench.report import write_report  # matplotlib only when the command runs

    result = write_report(runs, out, title)
    console.print(f"wrote {result.markdown}", highlight=False)
    for path in result.images:
        console.print(f"wrote {path}", highlight=False)
    for plot in result.skipped:
        console.print(f"skipped {plot.title}: {plot.reason}", highlight=False)
