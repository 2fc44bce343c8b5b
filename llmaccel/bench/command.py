"""`llmaccel bench {latency,throughput,serve,prefix,spec}`: the workloads of docs/workloads.md
through the backends of `llmaccel.bench.backends`, written as JSON lines + markdown +
per-request rows, and printed as a table."""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import typer

from llmaccel.errors import LLMAccelError

bench_app = typer.Typer(help="Measure speed: latency (W1), throughput (W2), serving (W3), "
                        "shared prefix (W4), speculation (W5).", no_args_is_help=True)

LOCAL_BACKENDS = ("llmaccel", "hf-eager", "hf-static-compile", "hf-cb")
MODEL_ARG = typer.Argument(None, help="Model: a benchmark shape (llama-3.2-3b), an HF "
                           "directory, a GGUF file or a hub id (default: the offline default "
                           "model). With --backend openai: also the served model's name.")


@dataclass
class Common:
    model: str | None
    backends: list[str]
    out: Path
    name: str | None
    quick: bool
    repeats: int
    warmup: int
    dtype: str
    load_format: str
    engine_kw: dict[str, Any]
    base_url: str | None
    served_model_name: str | None
    server_name: str
    api_key: str | None
    endpoint: str
    vocab_size: int | None
    slos: dict[str, float]
    usd_per_gpu_hour: float | None
    num_gpus: int
    progress: bool


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_engine_kw(items: list[str]) -> dict[str, Any]:
    """key=value pairs for the engine (EngineConfig fields); values parse as JSON where they
    can (numbers, true/false, objects), else stay strings."""
    from dataclasses import fields

    from llmaccel.engine.config import EngineConfig

    names = {f.name for f in fields(EngineConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in names:
            raise LLMAccelError(f"--engine-kw {item!r}: expected key=value with key one of "
                                f"{', '.join(sorted(names))}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def parse_slos(items: list[str]) -> dict[str, float]:
    """--goodput ttft:200 --goodput tpot:50 (milliseconds), as `vllm bench serve --goodput`."""
    from llmaccel.bench.metrics import check_slos

    slos: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition(":")
        try:
            slos[key] = float(raw) if sep else math.nan
        except ValueError:
            raise LLMAccelError(f"--goodput {item!r}: expected ttft|tpot|e2el:<ms>") from None
    try:
        return check_slos(slos)
    except ValueError as e:
        raise LLMAccelError(f"--goodput: {e}") from None


def common_options(
    model: Optional[str], backend: str, out: str, name: Optional[str], quick: bool,
    repeats: int, warmup: int, dtype: str, load_format: str, engine_kw: list[str],
    base_url: Optional[str], served_model_name: Optional[str], server_name: str,
    api_key: Optional[str], endpoint: str, vocab_size: Optional[int], goodput: list[str],
    usd_per_gpu_hour: Optional[float], num_gpus: int, no_progress: bool,
    device: Optional[str], allowed: tuple[str, ...]) -> Common:
    device_kw = use_device(device)
    backends = _csv(backend)
    bad = [b for b in backends if b not in allowed]
    if bad or not backends:
        raise LLMAccelError(f"--backend {backend!r}: this workload runs {', '.join(allowed)}")
    if "openai" in backends and not base_url:
        raise LLMAccelError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000)")
    engine = {**device_kw, **parse_engine_kw(engine_kw)}
    return Common(model, backends, Path(out), name, quick, repeats, warmup, dtype, load_format,
                  engine, base_url, served_model_name, server_name,
                  api_key or os.environ.get("OPENAI_API_KEY"), endpoint, vocab_size,
                  parse_slos(goodput), usd_per_gpu_hour, num_gpus, not no_progress)


def use_device(device: Optional[str]) -> dict[str, str]:
    """--device for the whole command (every bench command sets it: None resets an earlier
    choice); our engine's keyword for it."""
    from llmaccel.bench import hardware as hw

    try:
        hw.use_device(device)
    except (ValueError, RuntimeError) as e:
        raise LLMAccelError(f"--device: {e}") from None
    return {"device": device} if device else {}


def model_label(model: str | None) -> str:
    """What records call the model: a shape's name, or a file's / directory's stem."""
    path = Path(model if model is not None else _default_model())
    return path.stem if path.suffix == ".gguf" else path.name if path.exists() else model


def make_backend(kind: str, c: Common, max_model_len: int, forced: dict[str, Any] | None = None,
                 label: str | None = None):
    from llmaccel.bench.backends.engine import EngineBackend
    from llmaccel.bench.backends.hf import HFBackend
    from llmaccel.bench.backends.openai_client import OpenAIBackend

    if kind == "llmaccel":
        kwargs: dict[str, Any] = {"dtype": c.dtype, "load_format": c.load_format,
                                  "max_model_len": max_model_len, "skip_tokenizer_init": True,
                                  "enable_prefix_caching": False}
        return EngineBackend(c.model, {**kwargs, **c.engine_kw, **(forced or {})}, label)
    if kind in ("hf-eager", "hf-static-compile"):
        return HFBackend(c.model or _default_model(), kind, c.dtype,
                         "dummy" if c.load_format in ("dummy", "auto") else c.load_format)
    if kind == "openai":
        return OpenAIBackend(c.base_url, c.served_model_name or c.model or "default",
                             c.server_name, c.endpoint, c.api_key, _openai_vocab(c))
    raise LLMAccelError(f"unknown backend {kind!r}")


def _openai_vocab(c: Common) -> int | None:
    """Random-token prompts sent to a server need its vocabulary size: --vocab-size, else the
    benchmark shape's when MODEL names one (a server started on `llama-3.2-1b --load-format
    dummy` serves that shape's vocabulary)."""
    from llmaccel.models.shapes import SHAPES

    if c.vocab_size is not None:
        return c.vocab_size
    shape = SHAPES.get(c.model or "")
    return int(shape["vocab_size"]) if shape else None


def _default_model() -> str:
    from llmaccel.models.default_model import default_model_path

    return str(default_model_path())


def run_meta(command: str, device: str):
    import torch

    from llmaccel.bench.results import RunMeta, current_commit

    return RunMeta(device=device, torch=torch.__version__, commit=current_commit(),
                   command=command)


def _command() -> str:
    return "llmaccel " + shlex.join(sys.argv[1:])


def local_device_name() -> str:
    from llmaccel.bench import hardware as hw

    return hw.device_name(hw.default_device())


def write_outputs(c: Common, workload: str, records, rows, failures, title: str) -> Path:
    from llmaccel.bench.results import write_jsonl, write_markdown

    c.out.mkdir(parents=True, exist_ok=True)
    stem = c.name or f"{datetime.date.today().isoformat()}-{workload}-{model_label(c.model)}"
    jsonl = c.out / f"{stem}.jsonl"
    write_jsonl(jsonl, records)
    write_markdown(c.out / f"{stem}.md", records, failures, title=title,
                   header=[f"Command: `{_command()}`"])
    if rows:
        with open(c.out / f"{stem}.requests.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return jsonl


def print_table(records, failures, keys: tuple[str, ...]) -> None:
    from rich.console import Console
    from rich.table import Table

    from llmaccel.bench.results import roofline_notes

    table = Table(show_lines=False)
    table.add_column("backend")
    table.add_column("load")
    for k in keys:
        table.add_column(k, justify="right")
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for r in records:
        label, load = r.label, r.load
        rows.setdefault((label, load), {})[r.metric] = r.value
    for (label, load), vals in rows.items():
        table.add_row(label, load, *[f"{vals[k]:,.4g}" if k in vals else "–" for k in keys])
    console = Console()
    console.print(table)
    # a pct_roofline column is a percent of a measured copy figure, and can pass 100: say so
    for note in roofline_notes(records):
        console.print(note, highlight=False, markup=False)
    for f in failures:
        console.print(f"[red]{f.backend} failed:[/] {f.error}", highlight=False)


def run_backends(c: Common, workload: str, body, max_model_len: int,
                 variants: list[tuple[str, dict[str, Any] | None, str | None]] | None = None):
    """Run `body(backend, meta)` for each backend (each started and closed in turn); a
    backend that fails becomes a Failure in the outputs, the others still run."""
    from llmaccel.bench.results import Failure
    from llmaccel.bench.suites import SuiteOutput, with_backend

    records, rows, failures = [], [], []
    for kind in c.backends:
        for forced, label in (variants or [(None, None)]) if kind == "llmaccel" else \
                [(None, None)]:
            backend = make_backend(kind, c, max_model_len, forced, label)
            meta = run_meta(_command(), "remote server" if kind == "openai"
                            else local_device_name())
            try:
                out: SuiteOutput = with_backend(backend, lambda b=backend, m=meta: body(b, m))
            except (LLMAccelError, ValueError, RuntimeError, OSError) as e:
                text = " ".join(str(e).split()) or type(e).__name__
                failures.append(Failure(workload, model_label(c.model), backend.name,
                                        f"{type(e).__name__}: {text}"[:500]))
                continue
            records += out.records
            rows += out.rows
    return records, rows, failures


def _settings(c: Common):
    from llmaccel.bench.suites import SuiteSettings

    return SuiteSettings(model=model_label(c.model), load_format=c.load_format,
                         repeats=c.repeats, warmup=c.warmup, slos_ms=c.slos,
                         usd_per_gpu_hour=c.usd_per_gpu_hour, num_gpus=c.num_gpus,
                         progress=c.progress)


def _finish(c: Common, workload: str, records, rows, failures, title: str,
            keys: tuple[str, ...]) -> None:
    path = write_outputs(c, workload, records, rows, failures, title)
    print_table(records, failures, keys)
    typer.echo(f"wrote {path} (+ .md, .requests.jsonl)")
    if not records:
        raise LLMAccelError("every backend failed; see the errors above")


# -- options every workload shares ---------------------------------------------------------------
def _opt(default: Any, help: str, *names: str, **kw: Any):
    return typer.Option(default, *names, help=help, **kw)


_COMMON: list[tuple[str, Any, Any]] = [
    ("backend", str, _opt("llmaccel", "Comma-separated backends: llmaccel (our engine in "
                          "process), hf-eager, hf-static-compile, hf-cb, openai (any "
                          "OpenAI-compatible server at --base-url).")),
    ("out", str, _opt("results", "Directory for <name>.jsonl, .md and .requests.jsonl.")),
    ("name", Optional[str], _opt(None, "File stem (default: <date>-<workload>-<model>).")),
    ("quick", bool, _opt(False, "Small sizes a CPU gets through in seconds (smoke runs).",
                         "--quick")),
    ("repeats", int, _opt(3, "Timed repeats (median reported).", min=1)),
    ("warmup", int, _opt(1, "Untimed warm-up runs first.", min=0)),
    ("dtype", str, _opt("auto", "auto, bfloat16, float16 or float32.")),
    ("load_format", str, _opt("auto", "auto or dummy (random weights: speed only).")),
    ("engine_kw", list[str], _opt([], "key=value for our engine (any EngineConfig field, "
                                  "e.g. speculative_config='{\"method\": \"ngram\"}'); "
                                  "repeatable.")),
    ("base_url", Optional[str], _opt(None, "OpenAI-compatible server, e.g. "
                                     "http://127.0.0.1:8000.")),
    ("served_model_name", Optional[str], _opt(None, "Model name the server expects (default: "
                                              "MODEL).")),
    ("server_name", str, _opt("server", "Label of the server in results: openai:<label> "
                              "(vllm, sglang, llmaccel).")),
    ("api_key", Optional[str], _opt(None, "Bearer token (default: $OPENAI_API_KEY).")),
    ("endpoint", str, _opt("/v1/completions", "/v1/completions (token-id prompts) or "
                           "/v1/chat/completions.")),
    ("vocab_size", Optional[int], _opt(None, "Vocabulary size for random prompts sent to a "
                                       "server (local backends read their model's).", min=2)),
    ("goodput", list[str], _opt([], "SLO for goodput, ttft|tpot|e2el:<ms>; repeatable.")),
    ("usd_per_gpu_hour", Optional[float], _opt(None, "GPU rental price: adds $ per million "
                                               "output tokens.", min=0.0)),
    ("num_gpus", int, _opt(1, "GPUs the price applies to.", min=1)),
    ("no_progress", bool, _opt(False, "No progress bars.", "--no-progress")),
    ("device", Optional[str], _opt(None, "cpu or cuda[:N] for the local backends (default: "
                                   "a GPU when there is one).")),
]
_COMMON_NAMES = [n for n, _, _ in _COMMON]


def with_common(allowed: tuple[str, ...]):
    """Give a command the shared options (after its own), parse them into `Common` and pass
    it as `c`: one definition of the options for every workload."""
    import functools
    import inspect

    def deco(fn):
        own = [p for name, p in inspect.signature(fn).parameters.items()
               if name not in ("c", "model")]
        model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                  default=MODEL_ARG, annotation=Optional[str])
        shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=t)
                  for n, t, d in _COMMON]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any):
            common = {n: kwargs.pop(n) for n in _COMMON_NAMES}
            model_value = kwargs.pop("model", args[0] if args else None)
            c = common_options(model_value, allowed=allowed, **common)
            return fn(c=c, **kwargs)

        hints = typing_hints(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own]
        wrapper.__signature__ = inspect.Signature([model, *own, *shared])
        wrapper.__annotations__ = {p.name: p.annotation for p in [model, *own, *shared]}
        del wrapper.__wrapped__  # typer must read the new signature, not fn's
        return wrapper
    return deco


def typing_hints(fn) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(fn)


# -- the workloads ---------------------------------------------------------------------------------
def _spec(spec, quick_spec, c: Common, **overrides: Any):
    chosen = quick_spec if c.quick else spec
    return replace(chosen, **{k: v for k, v in overrides.items() if v is not None})


@bench_app.command("latency")
@with_common(("llmaccel", "hf-eager", "hf-static-compile", "openai"))
def bench_latency(
    c: Common,
    input_len: Optional[int] = typer.Option(None, min=1, help="Prompt tokens (W1: 128)."),
    output_len: Optional[int] = typer.Option(None, min=1, help="New tokens (W1: 256)."),
) -> None:
    """W1: batch-1 requests in turn; tok/s, TTFT, TPOT, ITL, E2EL, achieved GB/s and % of the
    copy-bandwidth roofline (local models)."""
    from llmaccel.bench import hardware as hw
    from llmaccel.bench import workloads as wl
    from llmaccel.bench.suites import latency

    spec = _spec(wl.W1Spec(), wl.QUICK_W1, c, prompt_len=input_len, new_tokens=output_len)
    copy = None
    if any(b != "openai" for b in c.backends):
        device = hw.default_device()
        copy = hw.measure_copy_bandwidth(device, nbytes=2**30 if device.type == "cuda"
                                         else 2**26, repeats=5)
    settings = _settings(c)
    records, rows, failures = run_backends(
        c, "W1", lambda b, meta: latency(b, spec, settings, meta, copy), spec.max_model_len)
    _finish(c, "W1", records, rows, failures, "W1 latency (batch 1)",
            ("tok_s", "ttft_ms_p50", "tpot_ms_p50", "itl_ms_p99", "e2e_ms_p50",
             "pct_roofline", "peak_mem_gib"))


@bench_app.command("throughput")
@with_common(("llmaccel", "hf-cb", "openai"))
def bench_throughput(
    c: Common,
    num_prompts: Optional[int] = typer.Option(None, min=1, help="Requests (W2: 256)."),
    output_len: Optional[int] = typer.Option(None, min=1, help="New tokens each (W2: 512)."),
) -> None:
    """W2: every request at once; output/total token throughput, request throughput,
    latency percentiles, peak memory, GPU utilization (NVML)."""
    from llmaccel.bench import workloads as wl
    from llmaccel.bench.suites import throughput

    spec = _spec(wl.W2Spec(), wl.QUICK_W2, c, num_requests=num_prompts,
                 new_tokens=output_len)
    settings = _settings(c)
    backends = [b for b in c.backends if b != "hf-cb"]
    records, rows, failures = run_backends(
        replace(c, backends=backends), "W2",
        lambda b, meta: throughput(b, spec, settings, meta), spec.max_model_len) \
        if backends else ([], [], [])
    if "hf-cb" in c.backends:
        from llmaccel.bench.engine_runs import EngineSettings
        from llmaccel.bench.hf_baselines import run_hf_cb_w2
        from llmaccel.bench.results import guarded

        meta = run_meta(_command(), local_device_name())
        outcome = guarded(lambda: run_hf_cb_w2(
            c.model or _default_model(), spec,
            EngineSettings(dtype="bfloat16" if c.dtype == "auto" else c.dtype,
                           repeats=c.repeats), meta), "W2", model_label(c.model), "hf-cb")
        for r in outcome.records:
            r.model = settings.model
        records += outcome.records
        failures += outcome.failures
    _finish(c, "W2", records, rows, failures, "W2 offline throughput",
            ("out_tok_s", "total_tok_s", "request_throughput", "ttft_ms_p50",
             "tpot_ms_p50", "e2e_ms_p99", "peak_mem_gib", "gpu_util_pct_mean"))


def _load_points(rates: str, concurrencies: str, burstiness: float):
    from llmaccel.bench.load import LoadPoint

    try:
        rate_list = [math.inf if r in ("inf", "max") else float(r) for r in _csv(rates)]
        conc_list = [int(x) for x in _csv(concurrencies)]
        if not rate_list:
            rate_list = [math.inf]
        points = [LoadPoint(r, None, burstiness) for r in rate_list if not conc_list]
        points += [LoadPoint(r, n, burstiness) for n in conc_list for r in rate_list]
    except ValueError as e:
        raise LLMAccelError(f"load points: {e}") from None
    return points


@bench_app.command("serve")
@with_common(("llmaccel", "openai"))
def bench_serve(
    c: Common,
    request_rate: str = typer.Option("1,4,16,64", help="Comma-separated req/s (inf: all at "
                                     "once); Poisson arrivals."),
    max_concurrency: str = typer.Option("", help="Comma-separated caps on requests in flight "
                                        "(W3: 1,8,32,128); combined with each rate."),
    burstiness: float = typer.Option(1.0, min=0.01, help="Gamma shape of arrival gaps (1: "
                                     "Poisson)."),
    num_prompts: Optional[int] = typer.Option(None, min=1, help="Requests per load point "
                                              "(default 200)."),
) -> None:
    """W3: requests arriving over time, input U(100,1024), output U(50,512); per load point
    `vllm bench serve`'s metrics (TTFT, TPOT, ITL, E2EL mean/median/p95/p99, throughputs,
    goodput)."""
    from llmaccel.bench import workloads as wl
    from llmaccel.bench.suites import serve

    spec = _spec(wl.W3Spec(), wl.QUICK_W3, c, num_prompts=num_prompts)
    points = _load_points(request_rate, max_concurrency, burstiness)
    settings = _settings(c)
    records, rows, failures = run_backends(
        c, "W3", lambda b, meta: serve(b, spec, points, settings, meta), spec.max_model_len)
    _finish(c, "W3", records, rows, failures, "W3 serving",
            ("request_throughput", "out_tok_s", "ttft_ms_mean", "ttft_ms_p99",
             "tpot_ms_mean", "itl_ms_p99", "e2e_ms_p50", "goodput", "failed"))


@bench_app.command("prefix")
@with_common(("llmaccel", "openai"))
def bench_prefix(
    c: Common,
    num_prompts: Optional[int] = typer.Option(None, min=1, help="Requests (W4: 64)."),
    prefix_len: Optional[int] = typer.Option(None, min=1, help="Shared prefix tokens "
                                             "(W4: 2000)."),
) -> None:
    """W4: one shared system prompt + a unique tail per request; our engine with its prefix
    cache off and on (same requests), or a server as it is configured."""
    from llmaccel.bench import workloads as wl
    from llmaccel.bench.suites import PREFIX_VARIANTS, prefix

    spec = _spec(wl.W4Spec(), wl.QUICK_W4, c, num_requests=num_prompts,
                 prefix_len=prefix_len)
    settings = _settings(c)
    variants = [({"enable_prefix_caching": on}, PREFIX_VARIANTS[on]) for on in (False, True)]
    records, rows, failures = run_backends(
        c, "W4", lambda b, meta: prefix(b, spec, settings, meta, getattr(b, "label", None)),
        spec.max_model_len, variants)
    _finish(c, "W4", records, rows, failures, "W4 shared prefix",
            ("ttft_ms_p50", "ttft_ms_p95", "ttft_ms_p99", "e2e_ms_p50", "out_tok_s"))


@bench_app.command("spec")
def bench_spec(
    model: Optional[str] = MODEL_ARG,
    speculative_config: list[str] = typer.Option(
        ['{"method": "ngram", "num_speculative_tokens": 4}'], help="JSON speculative config "
        "(vLLM's keys: method ngram|draft|head, model, num_speculative_tokens, ...); "
        "repeatable, one row set each."),
    batches: str = typer.Option("1,4,16,64", help="Comma-separated batch sizes."),
    kinds: str = typer.Option("code,prose", help="Prompt kinds: code, prose."),
    max_tokens: int = typer.Option(192, min=1, help="New tokens per request."),
    repeats: int = typer.Option(3, min=1, help="Timed repeats per engine (alternating)."),
    dtype: str = typer.Option("auto", help="auto, bfloat16, float16 or float32."),
    max_model_len: int = typer.Option(2048, min=16, help="Context of both engines."),
    engine_kw: list[str] = typer.Option([], help="key=value for both engines; repeatable."),
    out: str = typer.Option("results", help="Directory for <name>.jsonl and .md."),
    name: Optional[str] = typer.Option(None, help="File stem (default <date>-W5-<model>)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda[:N] (default: a GPU when "
                                         "there is one)."),
) -> None:
    """W5: speculative decoding against plain decoding on our engine (a real model: text
    prompts, real acceptance); speedup, acceptance (overall and per draft position), and
    whether greedy outputs stayed identical."""
    from rich.console import Console

    from llmaccel.bench import hardware as hw
    from llmaccel.bench.results import Failure
    from llmaccel.bench.spec_suite import SpecSettings, spec_cells
    from llmaccel.engine.llm import LLM

    try:
        configs = [json.loads(s) for s in speculative_config]
        settings = SpecSettings(tuple(int(b) for b in _csv(batches)), tuple(_csv(kinds)),
                                max_tokens, repeats)
    except (json.JSONDecodeError, ValueError) as e:
        raise LLMAccelError(f"bench spec: {e}") from None
    bad = [k for k in settings.kinds if k not in ("code", "prose")]
    if bad or not all(isinstance(c, dict) and c.get("method") for c in configs):
        raise LLMAccelError("bench spec: kinds are code/prose and every --speculative-config "
                            "is a JSON object with a method")
    base = {"dtype": dtype, "max_model_len": max_model_len, "enable_prefix_caching": False,
            **use_device(device), **parse_engine_kw(engine_kw)}
    c = Common(model, ["llmaccel"], Path(out), name, False, repeats, 0, dtype, "auto", base,
               None, None, "server", None, "/v1/completions", None, {}, None, 1,
               not no_progress)
    label = model_label(model)
    # One line per finished cell (no live display: its refresh thread would share the GIL
    # with the timed runs).
    console = Console(stderr=True)
    say = (lambda line: console.print(line, highlight=False)) if not no_progress else None
    records, failures = [], []
    plain = LLM(model, **base)
    meta = run_meta(_command(), hw.device_name(plain.engine.device))
    for cfg in configs:
        spec = None
        try:
            spec = LLM(model, **{**base, "speculative_config": cfg})
            records += spec_cells(plain, spec, cfg["method"], cfg, settings, meta, label, say)
        except (LLMAccelError, ValueError, RuntimeError) as e:
            failures.append(Failure("W5", label, f"llmaccel [{cfg['method']}]",
                                    f"{type(e).__name__}: {e}"[:500]))
        finally:
            del spec
            hw.release_memory()
    del plain
    hw.release_memory()
    for r in records:
        r.config["variant"] = f"{r.config['method']} {r.config['kind']} b{r.config['batch']}"
    _finish(c, "W5", records, [], failures, "W5 speculative decoding",
            ("speedup", "acceptance_rate", "mean_accepted_len", "out_tok_s"))


# -- programmatic use (recipes) ------------------------------------------------------------------
def run_workload(workload: str, model: str, out: str | Path, name: str,
                 **options: Any) -> Path:
    """`llmaccel bench <workload> MODEL --out OUT --name NAME ...` from Python (recipes call
    it): `options` by their command-line names (backend="llmaccel,hf-eager", quick=True,
    no_progress=True, ...), the rest at their defaults. Returns the .jsonl it wrote."""
    import inspect

    commands = {"latency": bench_latency, "throughput": bench_throughput,
                "serve": bench_serve, "prefix": bench_prefix, "spec": bench_spec}
    if workload not in commands:
        raise LLMAccelError(f"unknown workload {workload!r} (known: {', '.join(commands)})")
    fn = commands[workload]
    params = inspect.signature(fn).parameters
    unknown = set(options) - set(params)
    if unknown:
        raise LLMAccelError(f"bench {workload}: unknown option(s) {', '.join(sorted(unknown))}")
    kwargs = {n: getattr(p.default, "default", p.default) for n, p in params.items()}
    kwargs.update(model=model, out=str(out), name=name, **options)
    fn(**kwargs)
    return Path(out) / f"{name}.jsonl"
