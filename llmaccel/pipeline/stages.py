"""The stage functions: each reads its config and input models, writes its outputs into `out`
and returns a manifest (output paths relative to `out`, plus small facts for the report).
They call the public APIs of the layers below, the same ones the CLI commands call."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmaccel.pipeline.dag import StageNode
from llmaccel.progress import interactive


@dataclass
class StageInputs:
    """Resolved inputs of one stage run, by role: a model argument (path, hub id or shape)
    where the input is a model, and every input stage's directory and manifest."""
    source: str                                      # the recipe's model
    models: dict[str, str] = field(default_factory=dict)
    dirs: dict[str, Path] = field(default_factory=dict)
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # how long each input stage ran
    run_id: str = ""                                 # the run this stage runs in
    made_by: dict[str, str] = field(default_factory=dict)  # the run that made each input

    def fresh(self, role: str) -> bool:
        """Whether input `role` was made in this run (else it came from the cache)."""
        return bool(self.run_id) and self.made_by.get(role) == self.run_id

    @property
    def model(self) -> str:
        return self.models["model"]


def _device(config: dict[str, Any]) -> str | None:
    return None if config.get("device", "auto") == "auto" else config["device"]


def _training_args(config: dict[str, Any]) -> dict[str, Any]:
    """A training stage's config as FinetuneConfig / DistillConfig keywords (device None for
    auto)."""
    return {**config, "device": _device(config)}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def run_analyze(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    from llmaccel.analyze import analyze_config
    from llmaccel.models.config import load_hf_config
    from llmaccel.models.source import resolve_model_source

    source = resolve_model_source(inputs.model)
    result = analyze_config(load_hf_config(source), gpu=node.config.get("gpu"),
                            context=node.config.get("context", 0))
    _write_json(out / "analyze.json", {"model": source.name, **result})
    return {"analysis": "analyze.json", "model_name": source.name}


def run_convert(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    """A GGUF file dequantized once into an HF safetensors directory (what quantizers read)."""
    from llmaccel.quant.schemes import hf_source

    path = hf_source(inputs.model, out)
    return {"model": path.relative_to(out).as_posix()}


def run_finetune(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    from llmaccel.train.lora import FinetuneConfig, finetune

    res = finetune(FinetuneConfig(model=inputs.model, out=str(out),
                                  **_training_args(node.config)))
    return {"model": "merged", "result": "finetune.json", "baseline_ppl": res.baseline_ppl,
            "best_ppl": res.best_ppl, "best_step": res.best_step, "steps_run": res.steps_run,
            "stopped": res.stopped}


def run_quantize(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    from llmaccel.quant.schemes import quantize_scheme

    c = node.config
    res = quantize_scheme(Path(inputs.model), c["scheme"], out / "checkpoint",
                          device=_device(c), n_samples=c["n_samples"], seq_len=c["seq_len"],
                          data=c.get("data", "wikitext2"), show_progress=True)
    _write_json(out / "quantize.json", {"scheme": c["scheme"], **res.config})
    return {"model": "checkpoint", "scheme": c["scheme"], "quantization_config": res.config}


def run_eval(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    from llmaccel.eval.perplexity import evaluate_perplexity

    c = node.config
    res = evaluate_perplexity(inputs.model, data=c["data"], context=c["context"],
                              stride=c["stride"], limit=c["limit"], dtype=c["dtype"],
                              device=_device(c), progress=True)
    _write_json(out / "ppl.json", {"variant": c["variant"], **res.to_dict()})
    # The W6 record of docs/workloads.md, named as the bench stage names its records, so the
    # report joins perplexity and speed by config.quantization.
    from llmaccel.bench.results import make_record, write_jsonl

    config = {**_variant_facts(c), "context": res.context, "stride": res.stride,
              "windows": res.windows, "data": res.data, "joining": res.joining,
              "scored_tokens": res.scored_tokens, "limit": c["limit"]}
    write_jsonl(out / "W6.jsonl", [make_record(_meta(c), "W6", model_label(inputs.source),
                                               "llmaccel", config, "ppl", res.ppl,
                                               load_format="auto")])
    return {"result": "ppl.json", "records": "W6.jsonl", "variant": c["variant"],
            "ppl": res.ppl, "windows": res.windows, "context": res.context,
            "stride": res.stride}


def run_bench(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    """One workload (W1 latency, W2 throughput, W3 serve) through `llmaccel bench` on one
    variant; the records are renamed for the recipe: model = the recipe's model,
    config.quantization and config.variant = this variant."""
    from llmaccel.bench.command import run_workload

    c = node.config
    workload = c["workload"]
    extra = {"request_rate": ",".join(f"{r:g}" for r in c["request_rates"]),
             "num_prompts": c["num_prompts"]} if workload == "serve" else {}
    path = run_workload(workload, inputs.model, out, workload, backend=",".join(c["backends"]),
                        quick=c["quick"], repeats=c["repeats"], dtype=c["dtype"],
                        device=_device(c), no_progress=not interactive(), **extra)
    _relabel(path, inputs.source, _variant_facts(c), inputs.model, c["variant"])
    return {"records": [path.name], "variant": c["variant"], "workload": workload}


def _variant_facts(c: dict[str, Any]) -> dict[str, Any]:
    """config.quantization (a scheme, or the unquantized dtype: bf16 / fp32) and variant."""
    return {"quantization": c["scheme"] or dtype_label(c["dtype"], c.get("device", "auto")),
            "variant": c["variant"]}


def dtype_label(dtype: str, device: str) -> str:
    """What `auto` means where the stage runs: bf16 on a GPU, fp32 on the CPU."""
    import torch

    if dtype == "auto":
        on_gpu = device != "cpu" and torch.cuda.is_available()
        return "bf16" if on_gpu else "fp32"
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]


def model_label(model: str) -> str:
    from llmaccel.bench.command import model_label as label

    return label(model)


def _relabel(path: Path, source: str, facts: dict[str, Any] | None = None,
             built_from: str | None = None, variant: str | None = None) -> None:
    """Rewrite a bench file's records for the recipe: model = the recipe's model (not the
    stage directory's name), config extended by `facts`. The markdown beside it gets the same
    name in its headings: `built_from` (the checkpoint the stage ran) named them after its
    directory ("checkpoint" for every quantized variant)."""
    from llmaccel.bench.results import Record, read_jsonl, write_jsonl

    label = model_label(source)
    write_jsonl(path, [Record(**{**r.__dict__, "model": label,
                                 "config": {**r.config, **(facts or {})}})
                       for r in read_jsonl(path)])
    md = path.with_suffix(".md")
    if built_from is not None and md.exists():
        old = f" — {model_label(built_from)}"
        new = f" — {label}" + (f" ({variant})" if variant else "")
        md.write_text("\n".join(line.replace(old, new, 1) if line.startswith("## ") else line
                                for line in md.read_text().split("\n")))


def _meta(c: dict[str, Any]):
    """Device, torch, commit and the command that reran it (this `llmaccel run`)."""
    import shlex
    import sys

    import torch

    from llmaccel.bench import hardware as hw
    from llmaccel.bench.command import run_meta

    device = hw.default_device() if _device(c) is None else torch.device(_device(c))
    return run_meta("llmaccel " + shlex.join(sys.argv[1:]), hw.device_name(device))


def run_draft_head(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    """An EAGLE-style draft head trained on the target's own distribution (distill-draft)."""
    from llmaccel.train.distill import distill_draft
    from llmaccel.train.distill_common import DistillConfig

    res = distill_draft(DistillConfig(target=inputs.model, out=str(out / "head"), kind="head",
                                      **_training_args(node.config)))
    return {"model": "head", "result": "head/distill.json", "baseline_kl": res.baseline_kl,
            "best_kl": res.best_kl, "baseline_top1": res.baseline_top1,
            "best_top1": res.best_top1, "best_step": res.best_step,
            "steps_run": res.steps_run, "stopped": res.stopped}


def run_spec(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    """W5 (`llmaccel bench spec`): this speculative method against plain decoding, timed in
    turns on one engine, greedy outputs compared."""
    from llmaccel.bench.command import run_workload

    c = node.config
    spec: dict[str, Any] = {"method": {"model": "draft"}.get(c["method"], c["method"]),
                            "num_speculative_tokens": c["num_speculative_tokens"]}
    if "disable_by_batch_size" in c:
        spec["disable_by_batch_size"] = c["disable_by_batch_size"]
    if c["method"] == "model":
        spec["model"] = c["draft_model"]
    elif c["method"] == "head":
        spec["model"] = inputs.models["draft"]
    path = run_workload("spec", inputs.model, out, "W5", speculative_config=[json.dumps(spec)],
                        max_model_len=min(2048, _max_positions(inputs.model)),
                        batches=",".join(str(b) for b in c["batches"]),
                        kinds=",".join(c["kinds"]), max_tokens=c["max_tokens"],
                        repeats=c["repeats"], dtype=c["dtype"], device=_device(c),
                        no_progress=not interactive())
    # A named target variant goes into config.quantization (config.variant is W5's row label)
    target = {} if "variant" not in c else \
        {"quantization": _variant_facts(c)["quantization"], "target_variant": c["variant"]}
    _relabel(path, inputs.source, target, inputs.model, c.get("variant"))
    return {"records": [path.name], "method": c["method"], **(
        {"target_variant": c["variant"]} if "variant" in c else {})}


def _max_positions(model: str) -> int:
    from llmaccel.models.config import load_hf_config
    from llmaccel.models.source import resolve_model_source

    return int(getattr(load_hf_config(resolve_model_source(model)),
                       "max_position_embeddings", 2048))


def run_report(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    from llmaccel.pipeline.report import write_recipe_report

    path = write_recipe_report(inputs, out, node.config["title"], node.config.get("recipe"))
    return {"report": path.relative_to(out).as_posix()}


STAGES: dict[str, Callable[[StageNode, StageInputs, Path], dict[str, Any]]] = {
    "analyze": run_analyze,
    "convert": run_convert,
    "finetune": run_finetune,
    "quantize": run_quantize,
    "eval": run_eval,
    "bench": run_bench,
    "draft_head": run_draft_head,
    "spec": run_spec,
    "report": run_report,
}

__all__ = ["STAGES", "StageInputs"]
