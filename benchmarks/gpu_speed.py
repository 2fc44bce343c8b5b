"""GPU-speed benchmark: our engine against HF transformers on W1 (batch-1 decode), W2 (offline
throughput) and W4 (shared prefix, our prefix cache on vs off), one process, one GPU.

    python benchmarks/gpu_speed.py --workloads W1,W2,W4 --shapes llama-3.2-1b,llama-3.2-3b \\
        --backends llmaccel,hf-eager,hf-static-compile,hf-cb --out benchmarks/results \\
        [--quick] [--attention-backend triton] [--dtype bfloat16] [--engine-kw key=value ...]

Writes <out>/<date>-gpu-speed.jsonl (one record a line, BENCHMARKS.md's format) and a markdown
summary beside it, then prints a table. Backends run only where they apply: W1 llmaccel,
hf-eager, hf-static-compile; W2 llmaccel, hf-cb; W4 llmaccel (prefix cache off and on).
A backend that fails is logged and listed in the markdown; the others still run.
--shapes also takes a local HF model directory (its config.json; the weights stay random).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("gpu_speed")

BACKENDS = ("llmaccel", "hf-eager", "hf-static-compile", "hf-cb")
WORKLOADS = ("W1", "W2", "W4")
SUPPORTED = {"W1": ("llmaccel", "hf-eager", "hf-static-compile"), "W2": ("llmaccel", "hf-cb"),
             "W4": ("llmaccel",)}


def _csv(allowed: tuple[str, ...] | None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if allowed is not None and t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'nothing'} not in "
                                             f"{', '.join(allowed or ())}")
        return items
    return parse


def parse_engine_kw(items: list[str]) -> dict[str, Any]:
    """key=value pairs for EngineConfig; values are JSON where they parse (numbers, true/false,
    lists, which become tuples), else strings."""
    from llmaccel.engine.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--engine-kw {item!r}: expected key=value with key one of "
                             f"{', '.join(sorted(fields))}")
        lowered = raw.lower() if raw.lower() in ("true", "false", "null") else raw
        try:
            value = json.loads(lowered)
        except json.JSONDecodeError:
            value = raw
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", type=_csv(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--shapes", type=_csv(None), default=["llama-3.2-1b"],
                   help="benchmark shape names (or HF model directories), comma-separated")
    p.add_argument("--backends", type=_csv(BACKENDS), default=list(BACKENDS))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default=None, help="file stem (default <date>-gpu-speed)")
    p.add_argument("--append", action="store_true",
                   help="add to an existing <name>.jsonl and rebuild the markdown from all of it")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (CPU tests and smoke runs); not a measurement")
    p.add_argument("--attention-backend", default=None,
                   help="our engine's attention backend (default: the engine's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", type=_csv(None), default=["bf16"],
                   help="our engine in each scheme (llmaccel.quant.presets names, dummy codes; "
                        "bf16 = unquantized); HF baselines run once, with the first")
    p.add_argument("--engine-kw", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="extra EngineConfig keywords for our engine")
    p.add_argument("--variant", default=None,
                   help="a label for our engine's rows (e.g. the kernel settings "
                        "this process runs with), to compare runs appended to one file")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    p.add_argument("--hf-cb-repeats", type=int, default=None,
                   help="timed repeats of hf-cb alone (default --repeats); its runs take "
                        "minutes, and the record's config lists every repeat")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the bandwidth-test copy (default 1024, 64 with --quick)")
    return p


def _plan(workloads: list[str], backends: list[str]) -> list[tuple[str, str]]:
    plan = []
    for w in workloads:
        for b in backends:
            if b in SUPPORTED[w]:
                plan.append((w, b))
            else:
                logger.info("skipping %s on %s: not a baseline for that workload", b, w)
    return plan


def _runner(workload: str, backend: str, model: str, specs: dict, settings, meta, copy,
            settings_hf_repeats: int | None = None) -> list[Callable[[], list]]:
    """Zero-argument callables for one (workload, backend); W4 gives two (cache off, on)."""
    from llmaccel.bench import engine_runs as er
    from llmaccel.bench import hf_baselines as hf

    spec = specs[workload]
    if backend == "llmaccel":
        if workload == "W1":
            return [lambda: er.run_w1(model, spec, settings, meta, copy)]
        if workload == "W2":
            return [lambda: er.run_w2(model, spec, settings, meta)]
        return [lambda on=on: er.run_w4(model, spec, settings, meta, on) for on in (False, True)]
    if workload == "W1":
        return [lambda: hf.run_hf_w1(backend, model, spec, settings, meta, copy)]
    if settings_hf_repeats is not None:  # HF continuous batching takes minutes per repeat
        settings = dataclasses.replace(settings, repeats=settings_hf_repeats)
    return [lambda: hf.run_hf_cb_w2(model, spec, settings, meta)]


def _model_specs(model: str, quick: bool) -> dict:
    """The workloads' sizes, shrunk where a small test model has fewer positions."""
    from llmaccel.bench.workloads import fit_to_length, specs
    from llmaccel.models.config import make_model_config

    limit = getattr(make_model_config(model, load_format="dummy").hf_config,
                    "max_position_embeddings", None) or 2048
    return {w: fit_to_length(s, limit) for w, s in zip(WORKLOADS, specs(quick))}


def run(args: argparse.Namespace, command: str) -> tuple[Path, Path, list, list]:
    import torch

    from llmaccel.bench import hardware as hw
    from llmaccel.bench.engine_runs import EngineSettings
    from llmaccel.bench.results import (
        Outcome,
        RunMeta,
        current_commit,
        guarded,
        read_jsonl,
        write_jsonl,
        write_markdown,
    )

    device = hw.default_device()
    meta = RunMeta(hw.device_name(device), torch.__version__, current_commit(), command)
    copy_mib = args.copy_mib or (64 if args.quick else 1024)
    copy = hw.measure_copy_bandwidth(device, copy_mib * 2**20)
    logger.info("%s: copy bandwidth %.1f GB/s (%s)", meta.device, copy.gbps, copy.method)
    settings = EngineSettings(dtype=args.dtype, attention_backend=args.attention_backend,
                              engine_kwargs=parse_engine_kw(args.engine_kw),
                              repeats=args.repeats, variant=args.variant)
    outcome = Outcome()
    for model, quant, (workload, backend) in itertools.product(
            args.shapes, args.quantization, _plan(args.workloads, args.backends)):
        if backend != "llmaccel" and quant != args.quantization[0]:
            continue  # the baselines do not change with our quantization
        run_settings = dataclasses.replace(settings,
                                           quantization=None if quant == "bf16" else quant)
        specs = _model_specs(model, args.quick)
        for fn in _runner(workload, backend, model, specs, run_settings, meta, copy,
                          args.hf_cb_repeats):
            free = hw.free_memory_gib(device)
            logger.info("running %s%s %s on %s%s", backend,
                        "" if quant == "bf16" else f" [{quant}]", workload, model,
                        "" if free is None else f" ({free:.1f} GiB of GPU memory free)")
            outcome.extend(guarded(fn, workload, model, backend))
            hw.release_memory()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{datetime.date.today().isoformat()}-gpu-speed"
    jsonl, md = args.out / f"{stem}.jsonl", args.out / f"{stem}.md"
    records = (read_jsonl(jsonl) if args.append and jsonl.exists() else []) + outcome.records
    write_jsonl(jsonl, records)
    header = [f"Device: {meta.device}; torch {meta.torch}; commit `{meta.commit}`.",
              (f"Copy bandwidth (read + write): {copy.gbps:,.1f} GB/s ({copy.method}, "
               f"{copy.nbytes / 2**20:,.0f} MiB per copy)."),
              f"Command: `{command}`",
              ("Dummy (random) weights, greedy, EOS ignored; medians of the timed repeats. "
               "Each record's config in the .jsonl says how it was measured.")]
    if args.quick:
        header.append("**--quick: tiny sizes, not a measurement.**")
    write_markdown(md, records, outcome.failures, title=f"GPU speed, {stem}", header=header)
    return jsonl, md, outcome.records, outcome.failures


def print_table(records: list, failures: list) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="gpu_speed")
    for col in ("workload", "model", "backend", "metric", "value"):
        table.add_column(col, justify="right" if col == "value" else "left")
    for r in records:
        table.add_row(r.workload, escape(r.model), escape(r.row), r.metric, f"{r.value:,.2f}")
    console = Console()
    console.print(table)
    for f in failures:
        console.print(f"[red]{escape(f.backend)} {f.workload} {escape(f.model)} failed:[/] "
                      f"{escape(f.error)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        from rich.logging import RichHandler
        logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler()])
    command = "python benchmarks/gpu_speed.py " + shlex.join(argv)
    jsonl, md, records, failures = run(args, command)
    print_table(records, failures)
    print(f"wrote {jsonl} and {md}")
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
