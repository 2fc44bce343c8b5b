"""A recipe as a graph of stage runs: which run reads which output, in an order where every
input comes first, and the `--only` / `--from` selections over it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmaccel.pipeline.recipe import WORKLOAD_BACKENDS, BenchStage, Recipe, RecipeError
from llmaccel.quant.schemes import CALIBRATED, SCHEMES
from llmaccel.train.data import training_split

SOURCE = "model"  # the external input: the recipe's model, not a stage
# W5's timing harness, in the spec runs' keys: runs timed by an earlier harness are not
# reused. 2: offline LLM.generate (1: AsyncLLM streams, too noisy near 1x; spec_suite.py).
W5_HARNESS = 2


@dataclass
class StageNode:
    name: str                    # unique: "quantize.gptq-int4-g128", "eval.base"
    kind: str                    # the stage function: analyze, convert, finetune, ...
    config: dict[str, Any]       # what the stage reads besides its inputs (hashed)
    inputs: dict[str, str] = field(default_factory=dict)  # role -> node name or SOURCE
    # text the stage reads, as (data argument, split): found before any stage runs, and its
    # content hash is part of the stage's key
    reads: list[tuple[str, str]] = field(default_factory=list)


def _needs_hf_dir(model: str | None) -> bool:
    return model is not None and Path(model).suffix == ".gguf"


def build_graph(recipe: Recipe, model: str,
                fingerprint: Callable[[str], str] | None = None) -> list[StageNode]:
    """The stage runs of `recipe` on `model` (resolved: a path, hub id or shape), in order.
    `fingerprint` keys an external model named in the recipe (a draft model) by its bytes."""
    s = recipe.stages
    common = {"device": recipe.device, "dtype": recipe.dtype}
    nodes: list[StageNode] = []
    on = {k: getattr(s, k) is not None and getattr(s, k).enabled
          for k in ("analyze", "finetune", "quantize", "eval", "bench", "draft", "report")}
    if on["analyze"]:
        nodes.append(StageNode("analyze", "analyze", s.analyze.model_dump(exclude={"enabled"}),
                               {"model": SOURCE}))
    tuned = SOURCE
    if on["finetune"]:
        data = s.finetune.data or recipe.data
        nodes.append(StageNode("finetune", "finetune",
                               {**s.finetune.model_dump(exclude={"enabled"}), **common,
                                "data": data},
                               {"model": SOURCE}, [(data, training_split(data))]))
        tuned = "finetune"
    hf_dir = tuned
    base = SOURCE
    if on["quantize"] and s.quantize.methods:
        if tuned == SOURCE and _needs_hf_dir(model):  # quantizers read safetensors
            nodes.append(StageNode("convert", "convert", {}, {"model": SOURCE}))
            # The base variant's stages read the same dequantized weights from safetensors:
            # a 1.5B Q4_K_M GGUF took ~70 s a load on the GPU machine, safetensors seconds.
            hf_dir = base = tuned = "convert"
        q = s.quantize.model_dump(exclude={"enabled", "methods", "data"})
        data = s.quantize.data or recipe.data
        for scheme in s.quantize.methods:
            # only GPTQ and AWQ read text: the other schemes' keys do not depend on it
            calibrated = SCHEMES[scheme][0] in CALIBRATED
            nodes.append(StageNode(f"quantize.{scheme}", "quantize",
                                   {"scheme": scheme, **q, "device": recipe.device,
                                    **({"data": data} if calibrated else {})},
                                   {"model": hf_dir},
                                   [(data, "validation")] if calibrated else []))
    # The model variants evaluated and benchmarked: (label, node, quantization scheme or None)
    sources = {"base": base, "finetuned": tuned}
    variants: list[tuple[str, str, str | None]] = [
        (v, sources[v], None) if v in sources else (v, f"quantize.{v}", v)
        for v in s.variants()]
    if on["eval"]:
        data = s.eval.data or recipe.data
        e = {**s.eval.model_dump(exclude={"enabled"}), **common, "data": data}
        for label, src, scheme in variants:
            nodes.append(StageNode(f"eval.{label}", "eval",
                                   {**e, "variant": label, "scheme": scheme}, {"model": src},
                                   [(data, "test")]))
    if on["bench"]:
        nodes += _bench_nodes(s.bench, variants, common)
    if on["draft"]:
        d = s.draft
        train = {k: getattr(d, k) for k in ("steps", "batch_size", "seq_len",
                                            "max_blocks", "max_seconds", "eval_every",
                                            "patience")}
        train["data"] = d.data or recipe.data
        measure = {k: getattr(d, k) for k in ("num_speculative_tokens", "batches", "kinds",
                                              "max_tokens", "repeats")}
        if "head" in d.methods:
            # self-distillation asks the target about WikiText paragraphs (and code)
            head_data = train["data"]
            reads = [("wikitext2", "validation")] if head_data.startswith("self") else \
                [(head_data, training_split(head_data))]
            nodes.append(StageNode("draft.head", "draft_head", {**train, **common},
                                   {"model": tuned}, reads))
        # Targets: the workflow's model (one run per method, `spec.<method>`), or each named
        # variant (`spec.<method>.<variant>`, its config naming the variant).
        targets = [(None, tuned, None)] if d.variants is None else \
            [v for v in variants if v[0] in d.variants]
        for method in d.methods:
            for label, src, scheme in targets:
                inputs = {"model": src}
                config = {**measure, "method": method, **common, "harness": W5_HARNESS}
                if method in d.disable_by_batch_size:  # absent: the engine's switch alone
                    config["disable_by_batch_size"] = d.disable_by_batch_size[method]
                if label is not None:
                    config.update(variant=label, scheme=scheme)
                if method == "head":
                    inputs["draft"] = "draft.head"
                if method == "model":  # an external model: keyed by its bytes, like the target
                    config["draft_model"] = d.model
                    config["draft_model_key"] = fingerprint(d.model) if fingerprint else d.model
                name = f"spec.{method}" if label is None else f"spec.{method}.{label}"
                nodes.append(StageNode(name, "spec", config, inputs))
    if on["report"]:
        title = s.report.title or f"llmaccel recipe {recipe.name}"
        nodes.append(StageNode("report", "report",
                               {"title": title, "recipe": recipe.model_dump(mode="json")},
                               {n.name: n.name for n in nodes}))
    return nodes


def _bench_nodes(bench: BenchStage, variants: list[tuple[str, str, str | None]],
                 common: dict[str, Any]) -> list[StageNode]:
    """One stage run per variant and workload (`bench.gptq-int4-g128.latency`), so adding a
    workload or a backend re-runs only those, and no run outgrows a GPU lease's call. Each
    config holds only what that run reads."""
    shared = {"quick": bench.quick, "repeats": bench.repeats, **common}
    nodes = []
    for label, src, scheme in variants:
        baselines = bench.baseline_variants is None or label in bench.baseline_variants
        for workload in bench.workloads:
            if workload == "serve" and bench.serve_variants is not None \
                    and label not in bench.serve_variants:
                continue
            # HF transformers as the baseline on unquantized variants only: it would not run
            # our checkpoints' kernels, and a dequantized copy measures something else.
            backends = [k for k in bench.backends if k in WORKLOAD_BACKENDS[workload]
                        and (k == "llmaccel" or (baselines and scheme is None))]
            if not backends:
                continue
            extra = {"request_rates": bench.request_rates, "num_prompts": bench.num_prompts} \
                if workload == "serve" else {}
            nodes.append(StageNode(f"bench.{label}.{workload}", "bench",
                                   {**shared, "workload": workload, "backends": backends,
                                    **extra, "variant": label, "scheme": scheme},
                                   {"model": src}))
    return nodes


def dependents(nodes: list[StageNode], roots: set[str]) -> set[str]:
    """`roots` and every node that reads one of them, directly or not."""
    out = set(roots)
    for n in nodes:  # nodes are in order: inputs before readers
        if any(src in out for src in n.inputs.values()):
            out.add(n.name)
    return out


def select(nodes: list[StageNode], only: list[str] | None = None,
           start: str | None = None) -> set[str]:
    """Names of the nodes to run. `only`: these (a kind, like `quantize`, means all its
    runs); `start` (`--from`): that stage and everything downstream of it. Neither: all."""
    names = {n.name for n in nodes}

    def expand(term: str, flag: str) -> set[str]:
        hit = {n.name for n in nodes if n.name == term or n.kind == term}
        if not hit:
            raise RecipeError(f"{flag} {term!r}: no such stage in this recipe (stages: "
                              f"{', '.join(n.name for n in nodes)})")
        return hit

    chosen = set(names)
    if only:
        chosen = set().union(*(expand(t, "--only") for t in only))
    if start:
        chosen &= dependents(nodes, expand(start, "--from"))
    return chosen


__all__ = ["SOURCE", "StageNode", "build_graph", "dependents", "select"]
