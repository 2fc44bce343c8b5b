"""docs/workloads.md's quantization scheme names (rtn-int8, gptq-int4-g128, ...) applied to a real
model: the method, bits and group each name means, and one call that writes the checkpoint
(`quantize_scheme`). Used by `llmaccel eval ppl --quantization` and benchmarks/quant_ppl.py;
presets.py maps the same names to a config alone, for random-weight speed runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmaccel.errors import QuantizationError

# name -> (method, bits, group_size; None for the method's default, -1 per channel)
SCHEMES: dict[str, tuple[str, int, int | None]] = {
    "rtn-int8": ("rtn", 8, -1),
    "rtn-int4-g128": ("rtn", 4, 128),
    "nf4": ("nf4", 4, None),
    "hqq-int4": ("hqq", 4, None),
    "gptq-int4-g128": ("gptq", 4, 128),
    "gptq-int4-g128-act-order": ("gptq", 4, 128),  # desc_act: columns by decreasing diag(H)
    "awq-int4-g128": ("awq", 4, 128),
    "fp8": ("fp8", 8, None),
}
CALIBRATED = ("gptq", "awq")  # methods that need calibration text


def check_scheme(name: str) -> tuple[str, int, int | None]:
    if name not in SCHEMES:
        raise QuantizationError(f"unknown quantization scheme '{name}' (known: "
                                f"{', '.join(SCHEMES)})")
    return SCHEMES[name]


def hf_source(model: str | Path, work: Path) -> Path:
    """An HF safetensors directory for `model`: itself, or a GGUF file dequantized once into
    `work` (transformers reads GGUF; our quantizers read safetensors)."""
    path = Path(model).expanduser()
    if path.suffix != ".gguf":
        return path
    out = work / (path.stem + "-hf")
    if (out / "config.json").is_file():
        return out
    from llmaccel.models.convert import gguf_to_hf_dir

    gguf_to_hf_dir(path, out, torch.bfloat16, return_model=False)
    return out


def linear_in_features(src: Path) -> list[int]:
    """Input widths of the decoder's linears (attention in, o_proj in, down_proj in)."""
    cfg = json.loads((src / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    return [h, heads * hd, inter]


def fitting_group(src: Path, group: int | None) -> int | None:
    """`group` if it tiles every linear's input, else the largest of 64, 32 that does (-1: per
    channel). SmolLM2's 576-wide rows take no group 128."""
    if group is None or group == -1:
        return group
    ks = linear_in_features(src)
    for g in (group, 64, 32):
        if g <= group and all(k % g == 0 for k in ks):
            return g
    return -1


@dataclass
class SchemeResult:
    path: Path                       # the checkpoint directory
    config: dict[str, Any] = field(default_factory=dict)  # what a result record states


def quantize_scheme(src: Path, name: str, out_dir: Path, *, device: str | None = None,
                    n_samples: int = 128, seq_len: int = 2048, sink_weight: float | None = None,
                    act_order: bool = False, data: str = "wikitext2",
                    show_progress: bool = False) -> SchemeResult:
    """Quantize the HF directory `src` by scheme `name` into `out_dir`; calibration (GPTQ,
    AWQ) from the validation split of `data` (llmaccel.data.find_text; the other methods read
    no text). The returned config names method, bits, group (and a note where the scheme's
    group does not tile the model), format and calibration."""
    from llmaccel.quant.calibration import CalibConfig
    from llmaccel.quant.driver import quantize_model

    method, bits, group = check_scheme(name)
    group_used = fitting_group(src, group)
    calib = CalibConfig(data, n_samples, seq_len, 0)
    act_order = method == "gptq" and (act_order or name.endswith("act-order"))
    # Methods without calibration get no calibration batches either (they would only feed
    # the driver's per-layer error report).
    no_calib = None if method in CALIBRATED else torch.empty(0, 0, dtype=torch.long)
    report = quantize_model(src, method=method, bits=bits, group_size=group_used,
                            out_dir=out_dir, calib=calib, device=device,
                            calib_token_ids=no_calib, act_order=act_order,
                            sink_weight=sink_weight, show_progress=show_progress)
    config: dict[str, Any] = {"method": method, "bits": report.bits,
                              "group_size": report.group_size, "sym": report.sym,
                              "format": report.format, "quantize_s": round(report.seconds, 1)}
    if method in CALIBRATED:
        from llmaccel.data import find_text

        found = find_text(data, "validation")
        config["calibration"] = {"data": f"{found.name} {found.split}", "n_samples": n_samples,
                                 "seq_len": seq_len, "sha256": found.sha256()[:12]}
    if method == "gptq":
        from llmaccel.quant.gptq import sink_weight as gptq_sink_weight

        config["act_order"] = act_order
        config["sink_weight"] = gptq_sink_weight(seq_len, sink_weight)
    if group is not None and group_used != group:
        config["note"] = f"group {group} does not tile this model; used {group_used}"
    return SchemeResult(Path(out_dir), config)


__all__ = ["CALIBRATED", "SCHEMES", "SchemeResult", "check_scheme", "fitting_group",
           "hf_source", "linear_in_features", "quantize_scheme"]
