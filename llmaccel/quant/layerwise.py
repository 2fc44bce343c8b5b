"""Quantize the linears of one HF decoder layer (Llama/Qwen2/Mistral layout) in place.

The layer is given its calibration inputs (hidden states of every sample, from the already
quantized layers before it) and the keyword arguments the model passes to it (position
embeddings, mask). Each linear ends up holding its dequantized weight, so the layer's forward
afterwards is exactly what a reader of the checkpoint computes; `LinearQuant` keeps the codes
for packing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmaccel.errors import QuantizationError
from llmaccel.quant.awq import (
    ActivationStats,
    fold_scales_into_linear,
    fold_scales_into_norm,
    quantize_awq,
)
from llmaccel.quant.gptq import (
    HessianAccumulator,
    dequantize_with_g_idx,
    gptq_quantize,
    sink_weight,
)
from llmaccel.quant.rtn import QuantizedWeight, dequantize, quantize_rtn

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
O_PROJ, GATE_UP, DOWN = "self_attn.o_proj", ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"
LINEARS = (*QKV, O_PROJ, *GATE_UP, DOWN)
# GPTQ's "true sequential" order: each group sees inputs produced by the groups already
# quantized, so it compensates their error too.
SEQUENTIAL_GROUPS = (QKV, (O_PROJ,), GATE_UP, (DOWN,))


@dataclass(frozen=True)
class QuantSpec:
    method: str  # rtn | gptq | awq | hqq | nf4 | fp8 (fp8 ignores bits, group_size, scale_dtype)
    bits: int
    group_size: int
    sym: bool
    scale_dtype: torch.dtype
    damp_percent: float = 0.01
    act_order: bool = False
    sink_weight: float | None = None  # GPTQ: Hessian weight of each sequence's first token
    awq_n_grid: int = 20
    awq_clip: bool = True
    awq_max_tokens: int = 8192  # rows of x kept for AWQ's searches (stats use every token)


@dataclass(frozen=True)
class LinearQuant:
    qweight: QuantizedWeight
    g_idx: torch.Tensor | None = None  # GPTQ act-order only

    def dequantize(self) -> torch.Tensor:
        if self.g_idx is None:
            return dequantize(self.qweight)
        return dequantize_with_g_idx(self.qweight, self.g_idx)


def layer_output(out: Any) -> torch.Tensor:
    """HF decoder layers return a tensor (transformers 5) or a tuple (older releases)."""
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: list[torch.Tensor], kwargs: dict[str, Any]
              ) -> list[torch.Tensor]:
    return [layer_output(layer(x, **kwargs)) for x in inputs]


@torch.no_grad()
def capture_inputs(layer: nn.Module, names: tuple[str, ...], inputs: list[torch.Tensor],
                   kwargs: dict[str, Any], sink: Callable[[str, torch.Tensor], None]) -> None:
    """Run the layer on every sample, handing each named linear's input to `sink`."""
    def hook_for(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            sink(name, args[0].reshape(-1, args[0].shape[-1]))
        return hook
    handles = [layer.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        run_layer(layer, inputs, kwargs)
    finally:
        for h in handles:
            h.remove()


def _linear(layer: nn.Module, name: str) -> nn.Linear:
    try:
        mod = layer.get_submodule(name)
    except AttributeError:
        raise QuantizationError(f"decoder layer has no {name}; only Llama/Qwen2/Mistral-style "
                                "layers are supported") from None
    assert isinstance(mod, nn.Linear)
    return mod


def _store(layer: nn.Module, name: str, lq: LinearQuant) -> LinearQuant:
    lin = _linear(layer, name)
    lin.weight.data.copy_(lq.dequantize().to(lin.weight.device, lin.weight.dtype))
    return lq


def quantize_layer_rtn(layer: nn.Module, spec: QuantSpec) -> dict[str, LinearQuant]:
    return {n: _store(layer, n, LinearQuant(quantize_rtn(
        _linear(layer, n).weight.data, spec.bits, spec.group_size, spec.sym, spec.scale_dtype)))
        for n in LINEARS}


def quantize_layer_gptq(layer: nn.Module, inputs: list[torch.Tensor], kwargs: dict[str, Any],
                        spec: QuantSpec) -> dict[str, LinearQuant]:
    result: dict[str, LinearQuant] = {}
    for group in SEQUENTIAL_GROUPS:
        dev = _linear(layer, group[0]).weight.device
        hess = {n: HessianAccumulator(_linear(layer, n).in_features, dev) for n in group}
        # one call per calibration sequence: its first row is the sequence's first token
        w0 = sink_weight(inputs[0].shape[-2], spec.sink_weight) if inputs else 1.0
        capture_inputs(layer, group, inputs, kwargs,
                       lambda n, x: hess[n].add(x, first_row_weight=w0))
        for n in group:
            res = gptq_quantize(_linear(layer, n).weight.data, hess[n].hessian, spec.bits,
                                spec.group_size, spec.sym, spec.damp_percent,
                                act_order=spec.act_order, scale_dtype=spec.scale_dtype)
            g_idx = res.g_idx if res.act_order else None
            result[n] = _store(layer, n, LinearQuant(res.qweight, g_idx))
    return result


class _AwqInputs:
    """Per-channel mean |x| over every token, plus a bounded random subset of rows of x."""

    def __init__(self, in_features: int, rows_per_sample: int, seed: int) -> None:
        self.stats = ActivationStats(in_features)
        self.rows: list[torch.Tensor] = []
        self.rows_per_sample = rows_per_sample
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        self.stats.update(x)
        keep = torch.randperm(x.shape[0], generator=self.gen)[:self.rows_per_sample]
        self.rows.append(x[keep.to(x.device)].float())

    def x(self) -> torch.Tensor:
        return torch.cat(self.rows)


def quantize_layer_awq(layer: nn.Module, inputs: list[torch.Tensor], kwargs: dict[str, Any],
                       spec: QuantSpec) -> dict[str, LinearQuant]:
    """AWQ as its reference code does it: inputs of every linear captured once with the
    full-precision layer; the consumer of a folded scale (o, down) is searched before the
    producer it folds into (v, up), so the producer's search sees its final, folded weight."""
    points = {QKV[0]: QKV, O_PROJ: (O_PROJ,), GATE_UP[0]: GATE_UP, DOWN: (DOWN,)}
    per_sample = max(1, math.ceil(spec.awq_max_tokens / max(len(inputs), 1)))
    acts = {n: _AwqInputs(_linear(layer, n).in_features, per_sample, i)
            for i, n in enumerate(points)}
    capture_inputs(layer, tuple(points), inputs, kwargs, lambda n, x: acts[n].add(x))

    result: dict[str, LinearQuant] = {}
    v, o = _linear(layer, QKV[2]), _linear(layer, O_PROJ)
    # With grouped-query attention v_proj has fewer outputs than o_proj has inputs: one v
    # channel feeds several o inputs, so a per-o-input scale cannot be folded into v. o_proj
    # then gets s = 1 (n_grid=1 evaluates only alpha = 0) and keeps the clip search.
    fold_o = v.out_features == o.in_features
    plan = ((O_PROJ, (O_PROJ,), (QKV[2], "linear") if fold_o else None),
            (DOWN, (DOWN,), (GATE_UP[1], "linear")),
            (GATE_UP[0], GATE_UP, ("post_attention_layernorm", "norm")),
            (QKV[0], QKV, ("input_layernorm", "norm")))
    for point, names, fold in plan:
        weights = [_linear(layer, n).weight.data.float() for n in names]
        x = acts[point].x()
        res = quantize_awq(weights, x, spec.bits, spec.group_size, spec.sym,
                           spec.awq_n_grid if fold else 1, spec.awq_clip,
                           mean_abs=acts[point].stats.mean_abs().to(x.device),
                           scale_dtype=spec.scale_dtype)
        if fold is not None:
            _fold(layer, fold[0], fold[1], res.scales)
        for n, qw in zip(names, res.quantized):
            result[n] = _store(layer, n, LinearQuant(qw))
    return result


def _fold(layer: nn.Module, name: str, kind: str, scales: torch.Tensor) -> None:
    mod = layer.get_submodule(name)
    s = scales.to(mod.weight.device)
    if kind == "norm":
        mod.weight.data.copy_(fold_scales_into_norm(mod.weight.data.float(), s))
        return
    bias = None if mod.bias is None else mod.bias.data.float()
    new_w, new_b = fold_scales_into_linear(mod.weight.data.float(), s, bias)
    mod.weight.data.copy_(new_w)
    if new_b is not None:
        mod.bias.data.copy_(new_b)


def quantize_layer(layer: nn.Module, inputs: list[torch.Tensor], kwargs: dict[str, Any],
                   spec: QuantSpec) -> dict[str, LinearQuant]:
    """Quantize the layer's seven linears in place; returns their codes for packing."""
    if spec.method == "rtn":
        return quantize_layer_rtn(layer, spec)
    if spec.method == "fp8":  # no calibration: E4M3 weights, activation scales at run time
        from llmaccel.quant.fp8 import quantize_linears_fp8

        return quantize_linears_fp8(layer, LINEARS)  # type: ignore[return-value]
    if spec.method == "nf4":  # no calibration: bitsandbytes NF4, group_size is the blocksize
        from llmaccel.quant.nf4 import quantize_linears_nf4

        return quantize_linears_nf4(layer, LINEARS, spec.group_size)  # type: ignore[return-value]
    if spec.method == "hqq":  # no calibration: half-quadratic zero points, integer-snapped
        from llmaccel.quant.hqq import quantize_hqq

        return {n: _store(layer, n, LinearQuant(quantize_hqq(
            _linear(layer, n).weight.data, spec.bits, spec.group_size, spec.scale_dtype)))
            for n in LINEARS}
    if not inputs:
        raise QuantizationError(f"{spec.method} needs calibration data")
    if spec.method == "gptq":
        return quantize_layer_gptq(layer, inputs, kwargs, spec)
    if spec.method == "awq":
        return quantize_layer_awq(layer, inputs, kwargs, spec)
    raise QuantizationError(f"unknown method {spec.method!r}")
