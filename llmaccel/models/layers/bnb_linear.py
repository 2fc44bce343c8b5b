"""Serving bitsandbytes 4-bit NF4 checkpoints (`quant_method: bitsandbytes`) in our Transformer.

bitsandbytes names a weight's side tensors with dots ("q_proj.weight.absmax"), which cannot be
parameter names, so `BitsAndBytesConfig.checkpoint_weights` renames them on the way in
("q_proj.weight_absmax"); the loader then places q/k/v and gate/up shards as usual. Every shard
was quantized on its own flattened weight, so blocks never straddle shards: the method keeps a
quant state per shard, and `apply` dequantizes shard by shard (fp32 code * absmax, cast to the
activation dtype) and calls F.linear. That is the exact reference path, like
`PackedLinearMethod`; a fused NF4 kernel would replace `nf4_weight`.

Refused, each with a QuantizationError naming the key: 8-bit (LLM.int8) checkpoints, FP4,
double quantization (nested absmax), and quant_storage other than uint8.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.errors import CorruptCheckpointError, QuantizationError
from llmaccel.models.layers.quantization import (
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
)
from llmaccel.models.layers.packed_formats import (
    ABSMAX,
    dequantize_nf4_flat,
    NESTED,
    QUANT_MAP,
    QUANT_STATE_PREFIX,
    check_nf4_state,
    parse_quant_state,
    unpack_nibbles,
)
from llmaccel.models.layers.quant_configs import checkpoint_module_names

# checkpoint suffix -> our parameter name's suffix (after the module prefix)
_RENAMES = {".weight" + ABSMAX: ".weight_absmax", ".weight" + QUANT_MAP: ".weight_quant_map",
            ".weight" + QUANT_STATE_PREFIX + "nf4": ".weight_quant_state"}
_SIDE_PARAMS = ("weight_absmax", "weight_quant_map", "weight_quant_state")


def _bad(key: str, value: Any, supported: str) -> QuantizationError:
    return QuantizationError(f"quantization_config.{key}={value!r} is not supported for "
                             f"bitsandbytes checkpoints (supported: {supported})")


def _skipped(name: str, skip: list[str]) -> bool:
    # transformers skips a module a pattern matches as a suffix or as a leading dotted path;
    # vLLM when a pattern is one of its dotted components. Either way it stays unquantized.
    return any(name.endswith(s) or name.startswith(s + ".") or s in name.split(".")
               for s in skip)


class BitsAndBytesConfig(QuantizationConfig):
    """NF4 weights, no double quantization; lm_head and `llm_int8_skip_modules` stay plain."""

    name = "bitsandbytes"

    def __init__(self, skip_modules: list[str]) -> None:
        self.skip_modules = skip_modules

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> BitsAndBytesConfig:
        if raw.get("load_in_8bit") or raw.get("_load_in_8bit"):
            raise _bad("load_in_8bit", True, "false: only 4-bit NF4 checkpoints")
        if not (raw.get("load_in_4bit") or raw.get("_load_in_4bit")):
            raise QuantizationError(
                "quantization_config.quant_method='bitsandbytes' is supported for 4-bit NF4 "
                f"only, and load_in_4bit is {raw.get('load_in_4bit')!r}")
        checks = {"bnb_4bit_quant_type": (raw.get("bnb_4bit_quant_type", "fp4"), ("nf4",)),
                  "bnb_4bit_use_double_quant": (raw.get("bnb_4bit_use_double_quant", False),
                                                (False,)),
                  "bnb_4bit_quant_storage": (raw.get("bnb_4bit_quant_storage") or "uint8",
                                             ("uint8",))}
        for key, (value, allowed) in checks.items():
            if value not in allowed:
                raise _bad(key, value, f"{allowed}")
        skip = raw.get("llm_int8_skip_modules") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise _bad("llm_int8_skip_modules", skip, "a list of module names")
        return cls(skip)

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        if prefix.split(".")[-1] == "lm_head":
            return UnquantizedLinearMethod()
        names = checkpoint_module_names(prefix)
        skipped = {_skipped(n, self.skip_modules) for n in names}
        if len(skipped) > 1:
            raise QuantizationError(f"bitsandbytes: {', '.join(names)} are fused into one layer "
                                    "here but llm_int8_skip_modules skips only some of them")
        return UnquantizedLinearMethod() if skipped.pop() else BnB4bitLinearMethod()

    def checkpoint_weights(self, weights: Iterator[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for suffix, ours in _RENAMES.items():
                if name.endswith(suffix):
                    name = name[: -len(suffix)] + ours
                    break
            else:
                if QUANT_STATE_PREFIX in name or name.endswith(NESTED):
                    kind = ("double quantization (bnb_4bit_use_double_quant)"
                            if name.endswith(NESTED) else f"quant_type {name.rsplit('__', 1)[-1]}")
                    raise QuantizationError(f"checkpoint tensor {name!r}: bitsandbytes {kind} "
                                            "is not supported (supported: nf4 without nesting)")
            yield name, tensor


class BnB4bitLinearMethod(LinearMethodBase):
    """Checkpoint tensors per shard s (n_s = out_s * in): weight uint8 [ceil(n_s / 2), 1],
    absmax fp32, quant_map fp32 [16], quant_state JSON. After loading: `codes` uint8 [out, in]
    (unpacked once), `absmax` fp32 (all shards' blocks), `quant_map` fp32 [n_shards, 16]."""

    def describe(self, layer: nn.Module | None = None) -> str:
        sizes = sorted({bs for _, bs in getattr(layer, "bnb_blocks", [])})
        blocks = f" blocksize {'/'.join(map(str, sizes))}" if sizes else ""
        return f"bitsandbytes nf4{blocks} (reference: dequantize + F.linear)"

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        nbytes = [-(-size * input_size // 2) for size in output_sizes]
        starts = [sum(nbytes[:s]) for s in range(len(nbytes))]
        layer.bnb_state = [dict() for _ in output_sizes]  # absmax and blocksize per shard

        def shard_of(shard_id: int | None) -> int:
            if shard_id is None and len(output_sizes) > 1:
                raise ValueError(f"{layer.prefix} fuses {len(output_sizes)} bitsandbytes "
                                 "weights; the checkpoint must store them separately")
            return shard_id or 0

        def load_weight(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
            s = shard_of(shard_id)
            if loaded.dtype != torch.uint8:
                raise ValueError(f"dtype {loaded.dtype} does not fit packed uint8 (is this "
                                 "module quantized in the checkpoint?)")
            if loaded.numel() != nbytes[s]:
                raise ValueError(f"{loaded.numel()} packed bytes do not fit {nbytes[s]}")
            param.data[starts[s]:starts[s] + nbytes[s]].copy_(loaded.reshape(-1, 1))

        def load_absmax(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
            # its length depends on the blocksize in quant_state, which may come later
            layer.bnb_state[shard_of(shard_id)]["absmax"] = loaded.reshape(-1).float().clone()

        def load_quant_map(param: nn.Parameter, loaded: torch.Tensor,
                           shard_id: int | None) -> None:
            if loaded.numel() != 16:
                raise ValueError(f"quant_map has {loaded.numel()} values, expected 16")
            param.data[shard_of(shard_id)].copy_(loaded.reshape(-1))

        def load_state(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
            s = shard_of(shard_id)
            # its dtype is what bitsandbytes casts to; we cast to the activations' dtype
            blocksize, shape, _ = check_nf4_state(parse_quant_state(loaded),
                                                  f"{layer.prefix}[{s}].quant_state")
            if shape != [output_sizes[s], input_size]:
                raise ValueError(f"quant_state shape {shape} does not fit "
                                 f"{[output_sizes[s], input_size]}")
            layer.bnb_state[s]["blocksize"] = blocksize

        def param(shape, dtype, loader) -> nn.Parameter:
            p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            p.weight_loader = loader
            return p

        n = len(output_sizes)
        layer.register_parameter("weight", param((sum(nbytes), 1), torch.uint8, load_weight))
        # absmax and quant_state are stored on the layer; these stand in for the loader's
        # bookkeeping of which checkpoint tensors arrived.
        layer.register_parameter("weight_absmax", param((n,), torch.float32, load_absmax))
        layer.register_parameter("weight_quant_map", param((n, 16), torch.float32,
                                                           load_quant_map))
        layer.register_parameter("weight_quant_state", param((n,), torch.uint8, load_state))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, blocks = [], []
        for s, (size, state) in enumerate(zip(layer.output_sizes, layer.bnb_state)):
            if "absmax" not in state or "blocksize" not in state:
                raise CorruptCheckpointError(f"{layer.prefix}: shard {s} lacks its bitsandbytes "
                                             "absmax or quant_state")
            n = size * layer.input_size
            start = sum(-(-o * layer.input_size // 2) for o in layer.output_sizes[:s])
            packed = layer.weight.data[start:start + -(-n // 2)]
            if state["absmax"].numel() != -(-n // state["blocksize"]):
                raise CorruptCheckpointError(
                    f"{layer.prefix}: shard {s} has {state['absmax'].numel()} absmax values, "
                    f"expected {-(-n // state['blocksize'])} (blocksize {state['blocksize']})")
            codes.append(unpack_nibbles(packed, n).view(size, layer.input_size))
            blocks.append(state["absmax"])
        layer.bnb_blocks = [(b.numel(), st["blocksize"]) for b, st in zip(blocks, layer.bnb_state)]
        quant_map = layer.weight_quant_map.data
        for name in ("weight", *_SIDE_PARAMS):
            delattr(layer, name)
        del layer.bnb_state
        for name, t in (("codes", torch.cat(codes)), ("absmax", torch.cat(blocks)),
                        ("quant_map", quant_map)):
            t = t.to(quant_map.device).contiguous()
            layer.register_parameter(name, nn.Parameter(t, requires_grad=False))

    def apply(self, layer, x, bias=None):
        return F.linear(x, nf4_weight(layer, x.dtype), bias)


def nf4_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The layer's W [out, in] in `dtype`, each shard dequantized over its own blocks."""
    parts, row, block = [], 0, 0
    for s, (size, (n_blocks, blocksize)) in enumerate(zip(layer.output_sizes, layer.bnb_blocks)):
        absmax = layer.absmax[block:block + n_blocks]
        flat = dequantize_nf4_flat(layer.codes[row:row + size], absmax, layer.quant_map[s],
                                   blocksize)
        parts.append(flat.view(size, layer.input_size).to(dtype))
        row, block = row + size, block + n_blocks
    return parts[0] if len(parts) == 1 else torch.cat(parts)
