"""The recipe's report: the seed study's table (method x engine x throughput x perplexity x
memory) from the eval and bench stages' records, fine-tuning and quantization facts, then
`llmaccel report`'s tables and plots of every record. The records are copied beside it, so
the report directory stands alone."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmaccel.bench.report import fmt_value, write_report
from llmaccel.bench.results import Record, read_jsonl
from llmaccel.pipeline.stages import StageInputs

GIB = 1024 ** 3


def _fmt(v: float | None) -> str:
    return "–" if v is None else fmt_value(v)


def collect_records(inputs: StageInputs, out: Path) -> list[Path]:
    """Copy every input stage's record files into out/records/<stage>-<file>, each with its
    per-request sidecar (<stem>.requests.jsonl) where it has one: the latency CDFs read them."""
    dest = out / "records"
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for role, directory in inputs.dirs.items():
        files = inputs.manifests[role].get("records") or []
        for name in [files] if isinstance(files, str) else files:
            src = directory / name
            target = dest / f"{role}-{name}"
            shutil.copyfile(src, target)
            copied.append(target)
            side = src.with_name(src.stem + ".requests.jsonl")
            if side.is_file():
                shutil.copyfile(side, target.with_name(target.stem + ".requests.jsonl"))
    return copied


def method_engine_table(records: list[Record], variants: list[str],
                        made: Callable[[str], str] | None = None) -> list[str]:
    """One row per (variant, engine): W2 output tok/s, W1 tok/s, W6 perplexity (measured
    through our engine: the row of that variant), weights read per decode step, peak memory;
    `made(variant)`: whether this run measured the row or the cache held it."""
    cell: dict[tuple[str, str], dict[str, float]] = {}
    ppl: dict[str, float] = {}
    quant: dict[str, str] = {}
    for r in records:
        v = r.config.get("variant")
        if v is None:
            continue
        quant[v] = str(r.config.get("quantization", ""))
        if r.workload == "W6" and r.metric == "ppl":
            ppl[v] = r.value
            continue
        c = cell.setdefault((v, r.backend), {})
        if r.workload == "W2" and r.metric == "out_tok_s":
            c["w2"] = r.value
        elif r.workload == "W1" and r.metric == "tok_s":
            c["w1"] = r.value
        elif r.metric == "peak_mem_gib":
            c["peak"] = max(c.get("peak", 0.0), r.value)
        if r.workload == "W1" and "weight_bytes" in r.config:
            c["weights"] = r.config["weight_bytes"] / GIB
    lines = ["| method | quantization | engine | W2 out tok/s | W1 tok/s | perplexity | "
             "weights GiB / step | peak GiB |" + (" made |" if made else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if made else "")]
    for v in variants:
        engines = sorted({e for (vv, e) in cell if vv == v}, key=lambda e: (e != "llmaccel", e))
        for e in engines or ["llmaccel"]:
            c = cell.get((v, e), {})
            p = ppl.get(v) if e == "llmaccel" else None
            lines.append(f"| {v} | {quant.get(v, '')} | {e} | {_fmt(c.get('w2'))} | "
                         f"{_fmt(c.get('w1'))} | {_fmt(p)} | {_fmt(c.get('weights'))} | "
                         f"{_fmt(c.get('peak'))} |" + (f" {made(v)} |" if made else ""))
    return lines


def write_recipe_report(inputs: StageInputs, out: Path, title: str,
                        recipe: dict[str, Any] | None = None) -> Path:
    files = collect_records(inputs, out)
    records = [r for f in files for r in read_jsonl(f)]
    variants = []
    for role in inputs.dirs:
        v = inputs.manifests[role].get("variant")
        if role.split(".")[0] in ("eval", "bench") and v and v not in variants:
            variants.append(v)
    data = (recipe or {}).get("data") or "wikitext2"
    devices = sorted({r.device for r in records})
    commits = sorted({r.commit for r in records})
    md = [f"# {title}", "",
          f"Model: `{inputs.source}`. Device: {', '.join(devices) or '–'}. "
          f"Commit: {', '.join(c[:12] for c in commits) or '–'}. "
          "Made by `llmaccel run`; the records behind every number are in `records/`.", ""]
    if records:
        md += ["## Method x engine", "",
               "Throughput from `llmaccel bench` (W2: all requests at once; W1: batch 1), "
               f"perplexity from `llmaccel eval ppl` (the test split of `{data}`, through our "
               "engine; the HF rows run the same weights), weights read per decode step as "
               "the W1 roofline counts them; peak GPU memory where a GPU ran it. `made`: "
               "measured in this run (fresh) or held by the cache from the run named.", ""]

        def made(variant: str) -> str:
            return made_label(inputs, [r for r in inputs.dirs if r == f"eval.{variant}"
                                       or r.startswith(f"bench.{variant}.")])

        md += method_engine_table(records, variants, made) + [""]
        if Path(data).expanduser().is_file() and "finetune" in inputs.dirs:
            md += [f"`{data}` is one text file: fine-tuning trained on it and perplexity is "
                   "measured on it too, so the fine-tuned row's perplexity is optimistic "
                   "(a directory with separate validation and test files avoids this).", ""]
    md += _spec_section(records, inputs)
    md += _finetune_section(inputs) + _quantize_section(inputs) + _times_section(inputs)
    md += _recipe_section(recipe)
    body = ""
    if records:
        # The quantizers read the fine-tuned model when fine-tuning ran: it is the
        # unquantized point the formats are compared with, not the base.
        reference = "finetuned" if any(r.split(".")[0] == "finetune" for r in inputs.dirs) \
            else "base"
        bench = write_report(files, out, title, reference_variant=reference)
        # Its own heading dropped, its sections one level down, under ours.
        # Paths relative to the report (it is written in a temporary directory, then moved).
        text = bench.markdown.read_text().replace(f"{out}/", "")
        lines = text.splitlines()[1:]
        body = "\n".join(("#" + ln) if ln.startswith("#") else ln for ln in lines)
        md += ["## All measurements", ""]
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n" + body + "\n", encoding="utf-8")
    return path


def _spec_section(records: list[Record], inputs: StageInputs) -> list[str]:
    """W5 cells: speedup over plain decoding, acceptance, greedy output identical or not."""
    cells: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for r in records:
        if r.workload != "W5":
            continue
        target = str(r.config.get("target_variant", ""))
        c = cells.setdefault((target, r.config["method"], r.config["kind"], r.config["batch"]),
                             {"identical": r.config.get("identical_to_plain")})
        c[r.metric] = r.value
    if not cells:
        return []
    several = any(k[0] for k in cells)  # W5 on named target variants: a target column
    lines = ["## Speculative decoding (W5)", "",
             "Against plain decoding on the same engine, timed in turns; greedy outputs "
             "compared (in bf16 the verify pass and the one-token decode run different "
             "kernels, so a near-tie can flip a token; fp32 runs compare exactly).", "",
             ("| target " if several else "") + "| method | prompts | batch | speedup | "
             "acceptance rate | mean accepted length | tok/s | same output |",
             "|---" * (9 if several else 8) + "|"]
    for (target, method, kind, batch), c in cells.items():
        lines.append(("| " + target + " " if several else "") +
                     f"| {method} | {kind} | {batch} | {_fmt(c.get('speedup'))} | "
                     f"{_fmt(c.get('acceptance_rate'))} | "
                     f"{_fmt(c.get('mean_accepted_len'))} | {_fmt(c.get('out_tok_s'))} | "
                     f"{'yes' if c['identical'] else 'no'} |")
    spec_roles = [r for r in inputs.dirs if r.startswith("spec.")]
    lines += ["", "Made: " + "; ".join(f"{r} {made_label(inputs, [r])}" for r in spec_roles)
              + "."]
    head = inputs.manifests.get("draft.head")
    if head:
        lines += ["", f"The head: held-out top-1 agreement with the target "
                  f"{head['baseline_top1']:.1%} -> {head['best_top1']:.1%} after "
                  f"{head['steps_run']} steps (KL {head['baseline_kl']:.3f} -> "
                  f"{head['best_kl']:.3f})."]
    return lines + [""]


def made_label(inputs: StageInputs, roles: list[str]) -> str:
    """`fresh` when every stage in `roles` ran in this run, else which earlier run made the
    cached ones, so a reader never takes an old figure for a new one."""
    roles = [r for r in roles if r in inputs.dirs]
    if not roles:
        return "–"
    cached = [r for r in roles if not inputs.fresh(r)]
    if not cached:
        return "fresh"
    runs = ", ".join(sorted({inputs.made_by.get(r) or "an earlier run" for r in cached}))
    return f"cached: run {runs}" + ("" if len(cached) == len(roles) else " (the rest fresh)")


def _times_section(inputs: StageInputs) -> list[str]:
    """Each stage's own run time (from its stage.json, however long ago it ran), and whether
    this run made it or the cache held it."""
    if not inputs.seconds:
        return []
    lines = ["## Stages", "", f"This run: {inputs.run_id or '–'}. A cached stage's outputs "
             "(and every figure made from them) come from the run named.", "",
             "| stage | made | seconds |", "|---|---|---:|"]
    lines += [f"| {role} | {made_label(inputs, [role])} | {sec:.1f} |"
              for role, sec in inputs.seconds.items()]
    total = sum(inputs.seconds.values())
    return lines + [f"| all stages but this report | | {total:.1f} ({total / 60:.1f} min) |",
                    ""]


def _recipe_section(recipe: dict[str, Any] | None) -> list[str]:
    """The settings behind the numbers (sizes, steps, samples), as the recipe file would say."""
    if not recipe:
        return []
    import yaml

    stages = {k: {n: v for n, v in s.items() if v is not None and n != "enabled"}
              for k, s in recipe.get("stages", {}).items() if s and s.get("enabled", True)}
    text = yaml.safe_dump({**{k: v for k, v in recipe.items() if k != "stages"},
                           "stages": stages}, sort_keys=False, default_flow_style=None)
    return ["## Recipe", "", "```yaml", text.rstrip(), "```", ""]


def _finetune_section(inputs: StageInputs) -> list[str]:
    m = inputs.manifests.get("finetune")
    if not m:
        return []
    why = f"; stopped early: {m['stopped']}" if m.get("stopped") else ""
    return ["## Fine-tuning (LoRA)", "",
            f"Held-out perplexity {m['baseline_ppl']:.3f} -> {m['best_ppl']:.3f}, best at step "
            f"{m['best_step']} of {m['steps_run']}{why}. Later stages use the merged model.",
            ""]


def _quantize_section(inputs: StageInputs) -> list[str]:
    rows = [(role.partition(".")[2], m["quantization_config"])
            for role, m in inputs.manifests.items() if role.startswith("quantize.")]
    if not rows:
        return []
    lines = ["## Quantization", "", "| scheme | method | bits | group | format | seconds | "
             "note |", "|---|---|---|---|---|---|---|"]
    for scheme, c in rows:
        lines.append(f"| {scheme} | {c.get('method')} | {c.get('bits')} | "
                     f"{c.get('group_size')} | {c.get('format')} | {c.get('quantize_s')} | "
                     f"{c.get('note', '')} |")
    return lines + [""]


__all__ = ["collect_records", "method_engine_table", "write_recipe_report"]
