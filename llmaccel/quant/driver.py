"""`quantize_model`: an HF checkpoint in, a GPTQ / AWQ / compressed-tensors checkpoint out.

Layer by layer, so a model larger than the GPU quantizes: the HF model is loaded on the CPU,
the embeddings compute the calibration inputs of decoder layer 0, and then each layer in turn
moves to the device, is quantized with its own inputs, and produces the next layer's inputs
with its QUANTIZED weights (so later layers calibrate against, and compensate, the error that
really reaches them). Embeddings and norms stay unquantized, and so does lm_head unless asked
(`lm_head`, GPTQ format only).
"""

from __future__ import annotations

import copy
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmaccel.data import DataNotFoundError, find_text
from llmaccel.errors import LLMAccelError, QuantizationError, UnsupportedModelError
from llmaccel.progress import progress_bar
from llmaccel.quant.calibration import CalibConfig, calibration_batches
from llmaccel.quant.checkpoint import (
    FORMATS,
    check_format_settings,
    format_scale_dtype,
    pack_linear,
    quantization_config,
    write_checkpoint,
)
from llmaccel.quant.fp8 import check_fp8_settings
from llmaccel.quant.hqq import check_hqq_settings
from llmaccel.quant.layerwise import (
    LINEARS,
    LinearQuant,
    QuantSpec,
    quantize_layer,
    run_layer,
)
from llmaccel.quant.gptq import HessianAccumulator, gptq_quantize, sink_weight
from llmaccel.quant.nf4 import check_nf4_settings
from llmaccel.quant.rtn import check_group_size, quantize_rtn

METHODS = ("rtn", "gptq", "awq", "fp8", "nf4", "hqq")
DEFAULT_FORMAT = {"rtn": "compressed-tensors", "gptq": "gptq", "awq": "awq",
                  "fp8": "compressed-tensors",  # fp8: float-quantized (FP8_DYNAMIC)
                  "nf4": "bitsandbytes", "hqq": "compressed-tensors"}
# group_size None: 128, or the method's own default (bitsandbytes' blocksize, HQQ's group)
DEFAULT_GROUP_SIZE = {"nf4": 64, "hqq": 64}
log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class _StopForward(Exception):
    """Raised by the layer-0 hook: the rest of the model is not needed to get its inputs."""


@dataclass
class QuantizeReport:
    method: str
    format: str
    bits: int
    group_size: int
    sym: bool
    n_samples: int
    seq_len: int
    seconds: float = 0.0
    # relative output error ||y_q - y||^2 / ||y||^2 of each decoder layer on its calibration
    # inputs, for this method and for RTN on the same inputs
    layer_error: list[float] = field(default_factory=list)
    layer_error_rtn: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _settings(method: str, fmt: str | None, sym: bool | None, bits: int, group_size: int,
              act_order: bool) -> tuple[str, bool]:
    if method not in METHODS:
        raise QuantizationError(f"method must be one of {METHODS}, got {method!r}")
    fmt = fmt or DEFAULT_FORMAT[method]
    if fmt not in FORMATS:
        raise QuantizationError(f"format must be one of {FORMATS}, got {fmt!r}")
    sym = (method != "awq") if sym is None else sym  # AWQ's checkpoints are zero-point ones
    if act_order and (method != "gptq" or fmt != "gptq"):
        raise QuantizationError("act_order needs method gptq and format gptq (only GPTQ "
                                "checkpoints store the g_idx map)")
    check_format_settings(fmt, bits, group_size, sym)
    return fmt, sym


def _load(model: str, device: torch.device) -> tuple[nn.Module, Any, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmaccel.models.source import resolve_model_source

    source = resolve_model_source(model)
    if source.kind != "hf" or source.path is None:
        raise UnsupportedModelError(f"quantize needs an HF safetensors model directory or hub "
                                    f"id, got {source.kind} {model!r}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).eval()
    tokenizer = None
    # transformers 5 builds an EMPTY tokenizer for a directory without tokenizer files rather
    # than failing, so look for the files first.
    if any((source.path / f).is_file() for f in _TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.path)
        except Exception:  # unreadable tokenizer: fine when token ids are passed in
            tokenizer = None
    if not hasattr(getattr(hf, "model", None), "layers"):
        raise UnsupportedModelError(f"{type(hf).__name__} has no model.layers; quantize "
                                    "supports Llama/Qwen2/Mistral-style models")
    return hf, tokenizer, source.path


@torch.no_grad()
def _layer0_inputs(hf: nn.Module, ids: torch.Tensor, device: torch.device
                   ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Hidden states entering decoder layer 0 per sample, and the layer's keyword arguments
    (identical for every sample: same length, no padding, so position embeddings agree)."""
    body = hf.model
    layer0 = body.layers[0]
    inputs: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}

    def hook(_m: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        inputs.append(args[0] if args else kw["hidden_states"])
        if not kwargs:
            kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _StopForward

    body.embed_tokens.to(device)
    if hasattr(body, "rotary_emb"):
        body.rotary_emb.to(device)
    handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for row in ids:
            try:
                body(input_ids=row.unsqueeze(0).to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
        body.embed_tokens.to("cpu")
    kwargs.pop("past_key_values", None)
    kwargs.pop("past_key_value", None)
    return inputs, kwargs


def _rel_error(ys: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    num = sum(float((y.float() - r.float()).pow(2).sum()) for y, r in zip(ys, refs))
    den = sum(float(r.float().pow(2).sum()) for r in refs)
    return num / den if den > 0 else 0.0


# Methods whose weights need no calibration: their calibration text only feeds the per-layer
# error report, so the CLI reads less of it by default. SmolLM2-135M to FP8 on 2 CPU cores:
# 40 s with 16 sequences of 512 tokens; with 128 it ran over 10 minutes.
CALIBRATION_FREE = ("rtn", "fp8", "nf4", "hqq")


def default_n_samples(method: str) -> int:
    """The CLI's default number of calibration sequences for `method`."""
    return 16 if method in CALIBRATION_FREE else 128


def quantize_model(model: str | Path, method: str = "gptq", bits: int | None = None,
                   group_size: int | None = None,
                   sym: bool | None = None, out_dir: str | Path = "quantized",
                   calib: CalibConfig | None = None, format: str | None = None,
                   device: str | None = None, calib_token_ids: torch.Tensor | None = None,
                   act_order: bool = False, damp_percent: float = 0.01,
                   sink_weight: float | None = None, lm_head: bool = False,
                   compare_rtn: bool = True, show_progress: bool = True) -> QuantizeReport:
    """Quantize `model` (local HF directory or hub id) and write a checkpoint to `out_dir`.

    `calib_token_ids` [n_samples, seq_len] replaces tokenizing `calib` (tests; models without
    a tokenizer). RTN and FP8 need no calibration: without a tokenizer or ids they skip the
    per-layer error report. `bits` None means 4, or 8 for fp8 (which also ignores
    `group_size`: one scale per output channel). NF4 and HQQ need no calibration either;
    for nf4 `group_size` is the bitsandbytes blocksize. `group_size` None means 128, or 64 for
    nf4 and hqq. `sink_weight` (GPTQ): how many tokens each calibration sequence's first
    token counts as in the Hessian (None: seq_len / 64; 1: the plain Hessian; see
    `gptq.sink_weight`). `lm_head` quantizes the LM head too (rtn or gptq, in the gptq format:
    `lm_head: true`, untied from the embedding; GPTQ's Hessian comes from the final norm's
    outputs on the calibration text). Returns the report that is also saved as
    quantize_report.json.
    """
    start = time.perf_counter()
    if method == "fp8":  # E4M3, one scale per output channel: no bits / group size to choose
        format, bits, group_size, sym = check_fp8_settings(format, bits, sym), 8, -1, True
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE.get(method, 128)
    if method == "nf4":  # 4-bit NormalFloat, absmax per block: no zero points
        format, bits, sym = check_nf4_settings(format, bits, sym, group_size), 4, True
    elif method == "hqq":
        sym = check_hqq_settings(sym)
    elif format == "bitsandbytes":
        raise QuantizationError("the bitsandbytes format holds NF4 weights: use method nf4")
    bits = 4 if bits is None else bits
    fmt, sym = _settings(method, format, sym, bits, group_size, act_order)
    if lm_head and (method not in ("rtn", "gptq") or fmt != "gptq"):
        raise QuantizationError(f"--lm-head needs method rtn or gptq in the gptq format (got "
                                f"{method}, {fmt}): vLLM reads a quantized LM head only from "
                                "GPTQ checkpoints (lm_head: true)")
    calib = calib or CalibConfig()
    if calib_token_ids is None and method not in CALIBRATION_FREE:
        find_text(calib.source, "validation")  # missing text fails now, not after the load
    if Path(str(model)).expanduser().suffix == ".gguf":
        # the quantizers read safetensors: a GGUF file is dequantized into a temporary copy
        with _dequantized_gguf(model) as hf_dir:
            return quantize_model(hf_dir, method, bits, group_size, sym, out_dir, calib, fmt,
                                  device, calib_token_ids, act_order, damp_percent,
                                  sink_weight, lm_head, compare_rtn, show_progress)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    hf, tokenizer, src = _load(str(model), dev)
    for name in LINEARS:  # fail before calibration, not at layer 0 after minutes of it
        check_group_size(hf.model.layers[0].get_submodule(name).in_features, group_size)
    if calib_token_ids is None and tokenizer is not None:
        calib_token_ids = _report_batches(tokenizer, calib, method)
    if calib_token_ids is None and method not in CALIBRATION_FREE:
        raise LLMAccelError(f"{src} has no tokenizer to tokenize the calibration text")
    ids = calib_token_ids if calib_token_ids is not None else torch.empty(0, 0, dtype=torch.long)
    report = QuantizeReport(method, fmt, bits, group_size, sym, ids.shape[0], ids.shape[1])
    spec = QuantSpec(method, bits, group_size, sym, format_scale_dtype(fmt, src),
                     damp_percent=damp_percent, act_order=act_order, sink_weight=sink_weight)

    inputs, kwargs = _layer0_inputs(hf, ids, dev) if len(ids) else ([], {})
    tensors: dict[str, torch.Tensor] = {}
    layers = hf.model.layers
    with progress_bar(disable=not show_progress) as bar:
        task = bar.add_task(f"{method} int{bits}", total=len(layers))
        for i, layer in enumerate(layers):
            bar.update(task, description=f"{method} int{bits} · layer {i}")
            layer.to(dev)
            ref = copy.deepcopy(layer) if inputs else None
            quantized = quantize_layer(layer, inputs, kwargs, spec)
            outputs = run_layer(layer, inputs, kwargs)
            if ref is not None:
                _report_layer(report, ref, inputs, kwargs, outputs, spec, compare_rtn)
            tensors.update(_pack_layer(i, quantized, fmt, spec))
            layer.to("cpu")
            inputs = outputs
            bar.advance(task)

    if lm_head:
        with progress_bar(disable=not show_progress) as bar:
            bar.add_task(f"{method} int{bits} · lm_head", total=None)
            tensors.update(_quantize_lm_head(hf, inputs, fmt, spec, dev))
    qconfig = quantization_config(fmt, spec, lm_head=lm_head)
    write_checkpoint(Path(out_dir), hf, src, tensors, qconfig, tokenizer)
    report.seconds = round(time.perf_counter() - start, 3)
    (Path(out_dir) / "quantize_report.json").write_text(json.dumps(report.to_json(), indent=2))
    return report


@contextmanager
def _dequantized_gguf(model: str | Path) -> Iterator[Path]:
    """A GGUF file dequantized into a temporary safetensors directory, removed afterwards."""
    from llmaccel.quant.schemes import hf_source

    path = Path(str(model)).expanduser()
    if not path.is_file():
        raise UnsupportedModelError(f"no such file or directory: {model}")
    with tempfile.TemporaryDirectory(prefix="llmaccel-gguf-") as tmp:
        log.info("dequantizing %s to a safetensors model first (bf16)", path.name)
        yield hf_source(path, Path(tmp))


def _report_batches(tokenizer: Any, calib: CalibConfig, method: str) -> torch.Tensor | None:
    """Calibration ids. Methods that need none read text only for the per-layer error
    report: from the default dataset where it is on this machine (never downloaded), else no
    report; a source the user named must exist."""
    if method not in CALIBRATION_FREE or calib.source != CalibConfig().source:
        return calibration_batches(tokenizer, calib)
    try:
        find_text(calib.source, "validation", download=False)
    except DataNotFoundError:
        log.info("no calibration text on this machine: no per-layer error report")
        return None
    return calibration_batches(tokenizer, calib)


@torch.no_grad()
def _quantize_lm_head(hf: nn.Module, inputs: list[torch.Tensor], fmt: str, spec: QuantSpec,
                      dev: torch.device) -> dict[str, torch.Tensor]:
    """The LM head's packed tensors ("lm_head.*"): RTN, or GPTQ on the Hessian of its inputs
    (the final norm of the last layer's outputs, as GPTQModel's lm_head option does). The
    embedding keeps the plain table even where the head was tied to it."""
    head = hf.get_output_embeddings()
    weight = head.weight.data.to(dev, torch.float32).clone()
    if spec.method == "gptq":
        norm = hf.model.norm.to(dev)
        hess = HessianAccumulator(weight.shape[1], dev)
        w0 = sink_weight(inputs[0].shape[-2], spec.sink_weight) if inputs else 1.0
        for x in inputs:
            h = norm(x)
            hess.add(h.reshape(-1, h.shape[-1]), first_row_weight=w0)
        res = gptq_quantize(weight, hess.hessian, spec.bits, spec.group_size, spec.sym,
                            spec.damp_percent, act_order=spec.act_order,
                            scale_dtype=spec.scale_dtype)
        lq = LinearQuant(res.qweight, res.g_idx if res.act_order else None)
    else:
        lq = LinearQuant(quantize_rtn(weight, spec.bits, spec.group_size, spec.sym,
                                      spec.scale_dtype))
    return {f"lm_head.{key}": t.detach().cpu().contiguous()
            for key, t in pack_linear(lq, fmt, spec).items()}


def _report_layer(report: QuantizeReport, ref: nn.Module, inputs: list[torch.Tensor],
                  kwargs: dict[str, Any], outputs: list[torch.Tensor], spec: QuantSpec,
                  compare_rtn: bool) -> None:
    fp_out = run_layer(ref, inputs, kwargs)
    report.layer_error.append(_rel_error(outputs, fp_out))
    if compare_rtn:
        rtn = QuantSpec("rtn", spec.bits, spec.group_size, spec.sym, spec.scale_dtype)
        quantize_layer(ref, inputs, kwargs, rtn)
        report.layer_error_rtn.append(_rel_error(run_layer(ref, inputs, kwargs), fp_out))


def _pack_layer(index: int, quantized: dict[str, LinearQuant], fmt: str, spec: QuantSpec
                ) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}."
    out: dict[str, torch.Tensor] = {}
    for name, lq in quantized.items():
        for key, t in pack_linear(lq, fmt, spec).items():
            out[f"{prefix}{name}.{key}"] = t.detach().cpu().contiguous()
    return out


__all__ = ["METHODS", "DEFAULT_FORMAT", "QuantizeReport", "quantize_model"]
