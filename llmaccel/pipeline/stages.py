"""The stage functions: each reads its config and input models, writes its outputs into `out`
and returns a manifest (output paths relative to `out`, plus small facts for the report).
They call the public APIs of the layers below, the same ones the CLI commands call."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmaccel.pipeline.dag import StageNode


@dataclass
class StageInputs:
    """Resolved inputs of one stage run: role -> a model argument (path, hub id or shape)."""
    models: dict[str, str]

    @property
    def model(self) -> str:
        return self.models["model"]


def _device(config: dict[str, Any]) -> str | None:
    return None if config.get("device", "auto") == "auto" else config["device"]


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

    c = dict(node.config)
    device, dtype = _device(c), c.pop("dtype")
    c.pop("device")
    res = finetune(FinetuneConfig(model=inputs.model, out=str(out), device=device, dtype=dtype,
                                  **c))
    return {"model": "merged", "result": "finetune.json", "baseline_ppl": res.baseline_ppl,
            "best_ppl": res.best_ppl, "best_step": res.best_step, "steps_run": res.steps_run,
            "stopped": res.stopped}


def run_quantize(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    from llmaccel.quant.schemes import quantize_scheme

    c = node.config
    res = quantize_scheme(Path(inputs.model), c["scheme"], out / "checkpoint",
                          device=_device(c), n_samples=c["n_samples"], seq_len=c["seq_len"],
                          show_progress=True)
    _write_json(out / "quantize.json", {"scheme": c["scheme"], **res.config})
    return {"model": "checkpoint", "scheme": c["scheme"], "quantization_config": res.config}


def run_eval(node: StageNode, inputs: StageInputs, out: Path) -> dict[str, Any]:
    from llmaccel.eval.perplexity import evaluate_perplexity

    c = node.config
    res = evaluate_perplexity(inputs.model, data=c["data"], context=c["context"],
                              stride=c["stride"], limit=c["limit"], dtype=c["dtype"],
                              device=_device(c), progress=True)
    _write_json(out / "ppl.json", {"variant": c["variant"], **res.to_dict()})
    return {"result": "ppl.json", "variant": c["variant"], "ppl": res.ppl,
            "windows": res.windows, "context": res.context, "stride": res.stride}


STAGES: dict[str, Callable[[StageNode, StageInputs, Path], dict[str, Any]]] = {
    "analyze": run_analyze,
    "convert": run_convert,
    "finetune": run_finetune,
    "quantize": run_quantize,
    "eval": run_eval,
}

__all__ = ["STAGES", "StageInputs"]
