"""`llmaccel eval code MODEL`: functional code accuracy (pass@k) of a model, and of variants
of it (speculative decoding, quantization), on our problem set. cli.py registers `eval_code`
as `eval_app.command("code")`."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from llmaccel.cli import options as o
from rich.console import Console
from rich.table import Table

console = Console()


def eval_code(
    model: Optional[str] = typer.Argument(None, help=o.MODEL_HELP),
    limit: Optional[int] = typer.Option(None, min=1, help="Only the first N problems (a "
                                        "quick partial figure)."),
    max_tokens: int = typer.Option(384, min=1, help="Most tokens generated per completion."),
    chat: bool = typer.Option(False, "--chat", help="Ask through the chat template for the "
                              "completed function and test the first ```python block of the "
                              "reply (default: the model continues the prompt, as in "
                              "HumanEval)."),
    variant: list[str] = typer.Option(
        [], "--variant", help="NAME=JSON: also evaluate the model with these extra LLM "
        "keyword arguments (EngineConfig fields); repeat for several. E.g. 'ngram="
        "{\"speculative_config\": {\"method\": \"ngram\", \"num_speculative_tokens\": 4}}', "
        "'int8={\"hf_overrides\": {\"quantization_config\": {...}}}', 'gptq={\"model\": "
        "\"./gptq-dir\"}'. A variant named base (the plain settings) always runs first; for "
        "speculative variants the table counts greedy completions that differ from base's "
        "(should be 0)."),
    samples: int = typer.Option(1, min=1, help="Completions per problem; with n > 1 pass@k "
                                "is the unbiased estimate for k in 1, 5, 10, 100 up to n "
                                "(needs --temperature > 0)."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 is greedy."),
    timeout: float = typer.Option(10.0, min=0.1, help="Wall-clock seconds per program before "
                                  "its process group is killed."),
    memory_mb: int = typer.Option(1024, min=64, help="Address-space limit per program, in MB."),
    workers: Optional[int] = typer.Option(None, min=1, help="Programs tested at once, each "
                                          "in its own process (default: CPU cores, at most "
                                          "8)."),
    problems: Optional[str] = typer.Option(None, help="A JSON-lines problem file in "
                                           "HumanEval's layout (default: the built-in set)."),
    out: str = typer.Option("results", help="Directory for NAME-code.jsonl (records) and "
                            "NAME-code.problems.jsonl (every completion and its outcome)."),
    name: Optional[str] = typer.Option(None, help="File-name stem (default: from the model)."),
    dtype: str = o.DTYPE,
    device: Optional[str] = o.DEVICE,
    tokenizer: Optional[str] = o.TOKENIZER,
    max_model_len: Optional[int] = o.MAX_MODEL_LEN,
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of "
                                 "a table."),
) -> None:
    """Functional code accuracy (pass@1): the model completes Python functions, each program
    runs against its tests in a sandboxed process (limits on time, memory, files, processes;
    network off), and the share that passes is reported per variant."""
    from llmaccel.eval.code.problems import load_problems
    from llmaccel.eval.code.runner import (CodeEvalSettings, GenerationSettings, default_name,
                                           parse_variants, run_code_eval)
    from llmaccel.eval.code.sandbox import SandboxLimits

    variants = parse_variants(variant)  # before loading anything: bad JSON fails fast
    generation = GenerationSettings(mode="chat" if chat else "completion",
                                    max_tokens=max_tokens, samples=samples,
                                    temperature=temperature)
    engine_kwargs = o.engine_kwargs(locals())
    settings = CodeEvalSettings(
        model=model, problems=tuple(load_problems(problems, limit)), generation=generation,
        limits=SandboxLimits(timeout_s=timeout, memory_mb=memory_mb),
        variants=tuple(variants),
        engine_kwargs={k: v for k, v in engine_kwargs.items() if v is not None},
        workers=workers, out_dir=Path(out), name=name or default_name(model),
        command="llmaccel " + shlex.join(sys.argv[1:]))
    report = run_code_eval(settings, progress=not as_json, console=console)
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    render(report, console)


def render(report, console: Console) -> None:
    """The pass@k table of a CodeEvalReport, and where its files went."""
    first = report.variants[0]
    ks = first.ks
    table = Table(title=f"code: {report.model} — {first.n_problems} problems × {first.samples}"
                  f" sample(s)")
    table.add_column("variant")
    for k in ks:
        table.add_column(f"pass@{k}", justify="right")
    table.add_column("passed", justify="right")
    for status in ("failed", "error", "timeout", "memory"):
        table.add_column(status, justify="right")
    table.add_column("≠ base", justify="right")
    table.add_column("generate s", justify="right")
    table.add_column("test s", justify="right")
    for v in report.variants:
        counts = v.status_counts()
        differ = "–" if v.differing_from_base is None else str(v.differing_from_base)
        table.add_row(v.name, *[f"{v.pass_at(k):.1%}" for k in ks],
                      f"{v.passed}/{len(v.outcomes)}",
                      *[str(counts[s]) for s in ("failed", "error", "timeout", "memory")],
                      differ, f"{v.generate_s:.1f}", f"{v.test_s:.1f}")
    console.print(table)
    for v in report.variants:
        if v.differing_from_base:
            console.print(f"[yellow]{v.name}: {v.differing_from_base} greedy completion(s) "
                          "differ from base's: speculative decoding should not change greedy "
                          "output[/]")
    console.print(f"sandbox: {report.sandbox}; wrote {report.records_path} and "
                  f"{report.problems_path}", highlight=False)

