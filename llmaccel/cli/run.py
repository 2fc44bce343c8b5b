"""`llmaccel run [RECIPE.yaml]`: plan, print, run."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from llmaccel.cli import options as o
from llmaccel.pipeline.runner import Plan, execute, make_plan

console = Console()


def run(
    recipe: Optional[str] = typer.Argument(None, help="A recipe YAML file (default: the "
                                           "built-in recipe on the default model)."),
    size: str = typer.Option("small", help="The built-in recipe's sizes: small (a CPU gets "
                             "through in minutes) or full (docs/workloads.md's, for a GPU)."),
    model: Optional[str] = typer.Option(None, help="Run the recipe on this model instead of "
                                        "its own."),
    data: Optional[str] = typer.Option(None, help=o.DATA_HELP + " Every stage reads it "
                                       "instead of the recipe's text."),
    runs_dir: str = typer.Option("runs", help="Where stage outputs are kept: "
                                 "RUNS_DIR/<recipe>/<stage>-<hash>/."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (what is cached, "
                                 "what would run) and stop."),
    only: Optional[str] = typer.Option(None, help="Comma-separated stages to run (a kind "
                                       "such as quantize means all its runs); their inputs "
                                       "must be cached."),
    start: Optional[str] = typer.Option(None, "--from", help="Run this stage and everything "
                                        "downstream of it."),
    force: bool = typer.Option(False, help="Re-run the selected stages even if cached."),
) -> None:
    """Run a recipe: analyze -> finetune -> quantize -> eval, each stage cached under
    runs/<recipe>/ by a hash of its config and inputs, so a re-run redoes only what changed."""
    from llmaccel.pipeline.recipe import default_recipe, load_recipe

    if recipe is not None:
        r = load_recipe(recipe)
    elif size in ("small", "full"):
        r = default_recipe(size)  # type: ignore[arg-type]
    else:
        raise typer.BadParameter("small or full", param_hint="--size")
    if model is not None:
        r = r.model_copy(update={"model": model})
    if data is not None:
        r = r.with_data(data)
    only_list = [t.strip() for t in only.split(",") if t.strip()] if only else None
    plan = make_plan(r, runs_dir, only_list, start, force)
    print_plan(plan)
    if dry_run:
        return
    execute(plan, console)
    print_summary(plan)
    failed = [s for s in plan.stages if s.status in ("failed", "skipped")]
    if failed:
        console.print(f"[red]{len(failed)} stage(s) did not finish[/]: "
                      + "; ".join(f"{s.name}: {s.message}" for s in failed), highlight=False)
        raise typer.Exit(1)


def print_plan(plan: Plan) -> None:
    t = Table(title=f"recipe {plan.recipe.name} on {plan.model}")
    for col in ("stage", "plan", "reads", "directory"):
        t.add_column(col)
    for s in plan.stages:
        reads = "every stage above" if s.node.kind == "report" else \
            ", ".join(s.node.inputs.values())
        t.add_row(s.name, s.action, reads, plan.store.stage_dir(s.name, s.key).name)
    console.print(t)
    for text in plan.texts.values():
        console.print(f"text: {text.describe()}", highlight=False)


def print_summary(plan: Plan) -> None:
    t = Table(title=f"recipe {plan.recipe.name}: outputs under {plan.store.root}")
    for col in ("stage", "status", "seconds", "note"):
        t.add_column(col)
    for s in plan.stages:
        note = s.message
        if s.cached and not note:
            m = s.cached.manifest
            note = (f"ppl {m['ppl']:.3f}" if "ppl" in m else
                    f"held-out ppl {m['baseline_ppl']:.2f} -> {m['best_ppl']:.2f}"
                    if "best_ppl" in m else "")
        t.add_row(s.name, s.status, f"{s.seconds:.1f}" if s.status == "ran" else "", note)
    console.print(t)
