"""Plan and run a recipe: key every stage run (config + input keys), reuse what the cache holds,
run the rest in order. A failed stage stops the stages that read its outputs, with a message
naming it; everything else goes on, and finished outputs stay for the next run."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmaccel.pipeline.cache import Fingerprints, StageRecord, Store, stage_key
from llmaccel.pipeline.dag import SOURCE, StageNode, build_graph, select
from llmaccel.pipeline.recipe import Recipe, RecipeError
from llmaccel.pipeline.stages import STAGES, StageInputs

if TYPE_CHECKING:
    from llmaccel.data import TextData

StageFn = Callable[[StageNode, StageInputs, Path], dict[str, Any]]


@dataclass
class PlannedStage:
    node: StageNode
    key: str
    input_keys: dict[str, str]
    selected: bool
    cached: StageRecord | None
    action: str = ""             # run | cached | not selected
    status: str = ""             # after running: ran | cached | failed | skipped
    message: str = ""
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.node.name


@dataclass
class Plan:
    recipe: Recipe
    model: str
    model_key: str
    store: Store
    stages: list[PlannedStage] = field(default_factory=list)
    run_id: str = ""             # names this run in each stage.json it writes
    texts: dict[tuple[str, str], TextData] = field(default_factory=dict)  # what stages read

    def by_name(self) -> dict[str, PlannedStage]:
        return {s.name: s for s in self.stages}


def resolve_model(recipe: Recipe) -> str:
    if recipe.model is not None:  # "~/..." paths as a shell would read them (hub ids unchanged)
        return str(Path(recipe.model).expanduser()) if recipe.model.startswith("~") \
            else recipe.model
    from llmaccel.models.default_model import default_model_path

    return str(default_model_path())


def make_plan(recipe: Recipe, runs_dir: str | Path = "runs", only: list[str] | None = None,
              start: str | None = None, force: bool = False,
              model: str | None = None) -> Plan:
    """Key every stage run of `recipe` and decide what to run: selected stages whose output
    is not cached (all selected ones with `force`)."""
    model = model or resolve_model(recipe)
    check_models(recipe, model)
    root = Path(runs_dir)
    prints = Fingerprints(root / ".fingerprints.json")
    model_key = prints.of_model(model)
    store = Store(root / recipe.name)
    nodes = build_graph(recipe, model, prints.of_model)
    prints.save()
    chosen = select(nodes, only, start)
    plan = Plan(recipe, model, model_key, store)
    texts = plan.texts = find_texts(nodes)  # every stage's text, before any stage runs
    keys: dict[str, str] = {SOURCE: model_key}
    for node in nodes:
        input_keys = {role: keys[src] for role, src in node.inputs.items()}
        input_keys.update({f"text.{data}.{split}": "sha256:" + texts[data, split].sha256()
                           for data, split in node.reads})
        key = stage_key(node.kind, node.config, input_keys)
        keys[node.name] = key
        cached = store.lookup(node.name, key)
        st = PlannedStage(node, key, input_keys, node.name in chosen, cached)
        st.action = ("run" if st.selected and (force or cached is None)
                     else "cached" if cached is not None else "not selected")
        plan.stages.append(st)
    by = plan.by_name()
    for st in plan.stages:  # a stage to run needs every input stage run or cached
        if st.action != "run":
            continue
        for src in st.node.inputs.values():
            if src != SOURCE and by[src].action == "not selected":
                raise RecipeError(f"stage {st.name} needs {src}, which is neither cached nor "
                                  f"selected: select it too (or drop --only/--from)")
    return plan


def check_models(recipe: Recipe, model: str) -> None:
    """The recipe's model and draft model exist (a local path) or resolve (a hub id, a
    shape): a typo stops the run before its first stage, in one line."""
    from llmaccel.models.source import resolve_model_source

    draft = recipe.stages.draft
    for name in [model] + ([draft.model] if draft is not None and draft.enabled
                           and draft.model and "model" in draft.methods else []):
        resolve_model_source(name)


def find_texts(nodes: list[StageNode]) -> dict[tuple[str, str], TextData]:
    """Where each (data, split) the stages read is: found (or downloaded) now, so a missing
    dataset stops the run before its first stage, in one line."""
    from llmaccel.data import DataNotFoundError, find_text

    found: dict[tuple[str, str], TextData] = {}
    for node in nodes:
        for data, split in node.reads:
            if (data, split) not in found:
                try:
                    found[data, split] = find_text(data, split)
                except DataNotFoundError as e:
                    raise RecipeError(f"stage {node.name}: {e}") from None
    return found


def execute(plan: Plan, console: Any = None, stage_fns: dict[str, StageFn] | None = None,
            ) -> Plan:
    """Run the plan's `run` stages in order; fill in each stage's status."""
    fns = stage_fns or STAGES
    by = plan.by_name()
    plan.run_id = plan.run_id or time.strftime("%Y%m%d-%H%M%S")
    to_run, done = sum(st.action == "run" for st in plan.stages), 0
    for st in plan.stages:
        if st.action != "run":
            st.status = "cached" if st.action == "cached" else "not selected"
            continue
        failed = [src for src in st.node.inputs.values()
                  if src != SOURCE and by[src].status in ("failed", "skipped")]
        if failed:
            st.status = "skipped"
            st.message = f"not run: its input {failed[0]} " + \
                ("failed" if by[failed[0]].status == "failed" else "was not run")
            _say(console, f"[yellow]skip[/] {st.name}: {st.message}")
            continue
        inputs = _inputs_of(plan, by, st.node)
        tmp = plan.store.begin(st.name, st.key)
        done += 1
        _say(console, f"[bold]run[/] {st.name} [dim]({done} of {to_run})[/]")
        t0 = time.perf_counter()
        try:
            manifest = fns[st.node.kind](st.node, inputs, tmp)
        except Exception as e:  # a failed stage stops its readers, not the run
            st.seconds = time.perf_counter() - t0
            plan.store.abandon(tmp)
            st.status = "failed"
            st.message = f"{type(e).__name__}: {e}"
            (plan.store.root / f"{st.name}.error.log").write_text(traceback.format_exc())
            _say(console, f"[red]failed[/] {st.name}: {st.message}")
            continue
        st.seconds = time.perf_counter() - t0
        st.cached = StageRecord(st.name, st.node.kind, st.key, st.node.config, st.input_keys,
                                manifest, round(st.seconds, 2), run_id=plan.run_id)
        plan.store.commit(tmp, st.cached)
        error_log = plan.store.root / f"{st.name}.error.log"
        error_log.unlink(missing_ok=True)
        st.status = "ran"
        _say(console, f"[green]done[/] {st.name} in {st.seconds:.1f}s")
    _write_summary(plan)
    return plan


def _inputs_of(plan: Plan, by: dict[str, PlannedStage], node: StageNode) -> StageInputs:
    inputs = StageInputs(source=plan.model, run_id=plan.run_id)
    for role, src in node.inputs.items():
        if src == SOURCE:
            inputs.models[role] = plan.model
            continue
        st = by[src]
        assert st.cached is not None, f"{src} has no output"  # make_plan/execute ensure it
        directory = plan.store.stage_dir(src, st.key)
        inputs.dirs[role], inputs.manifests[role] = directory, st.cached.manifest
        inputs.seconds[role] = st.cached.seconds
        inputs.made_by[role] = st.cached.run_id or st.cached.finished_at
        if "model" in st.cached.manifest:
            inputs.models[role] = str(directory / st.cached.manifest["model"])
    return inputs


def _say(console: Any, text: str) -> None:
    if console is not None:
        console.print(text, highlight=False)


def _write_summary(plan: Plan) -> None:
    """runs/<recipe>/run.json: the last run's stages, keys, statuses and output directories
    (what the report reads; stage.json in each directory has the rest)."""
    plan.store.root.mkdir(parents=True, exist_ok=True)
    rows = [{"name": s.name, "kind": s.node.kind, "key": s.key, "status": s.status,
             "message": s.message, "seconds": round(s.seconds, 2),
             "dir": (plan.store.stage_dir(s.name, s.key).name if s.cached else None),
             "made_by": s.cached.run_id if s.cached else None,
             "inputs": s.node.inputs}
            for s in plan.stages]
    summary = {"run_id": plan.run_id, "recipe": plan.recipe.model_dump(), "model": plan.model,
               "model_key": plan.model_key, "stages": rows,
               "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (plan.store.root / "run.json").write_text(json.dumps(summary, indent=2, default=str))


__all__ = ["Plan", "PlannedStage", "execute", "make_plan", "resolve_model"]
