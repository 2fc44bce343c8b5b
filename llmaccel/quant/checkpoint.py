"""Writing a quantized checkpoint: per-format packing, `quantization_config`, the files.

The output directory is what vLLM / transformers expect of a quantized HF model: config.json
(the source's, plus `quantization_config`), model.safetensors (packed linears under their HF
names, every other tensor plain, in the source's dtype), tokenizer and generation config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from llmaccel.errors import QuantizationError
from llmaccel.quant.formats.awq import awq_quantization_config, check_awq_settings, pack_awq
from llmaccel.quant.formats.bitsandbytes import bnb_quantization_config, pack_bnb_nf4
from llmaccel.quant.formats.compressed_tensors import (
    check_ct_settings,
    compressed_tensors_quantization_config,
    pack_compressed_tensors,
)
from llmaccel.quant.formats.gptq import gptq_quantization_config, pack_factor, pack_gptq
from llmaccel.quant.nf4 import check_blocksize

if TYPE_CHECKING:
    from llmaccel.quant.layerwise import LinearQuant, QuantSpec

FORMATS = ("gptq", "awq", "compressed-tensors", "bitsandbytes")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def check_format_settings(fmt: str, bits: int, group_size: int, sym: bool) -> None:
    """Reject bits / group sizes the format cannot store, before any model is loaded."""
    if group_size != -1 and group_size <= 0:
        raise QuantizationError(f"group_size must be positive or -1, got {group_size}")
    if fmt == "gptq":
        pack_factor(bits)
    elif fmt == "awq":
        check_awq_settings(bits, group_size)
    elif fmt == "compressed-tensors":
        check_ct_settings(bits, group_size)
    elif fmt == "bitsandbytes":  # NF4; group_size is the blocksize
        if bits != 4:
            raise QuantizationError(f"the bitsandbytes format holds 4-bit NF4 codes, got "
                                    f"bits={bits}")
        check_blocksize(group_size)
    else:
        raise QuantizationError(f"format must be one of {FORMATS}, got {fmt!r}")


def source_dtype(src: Path) -> torch.dtype:
    """The dtype the source checkpoint declares (bf16 when it says nothing usable)."""
    try:
        cfg = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return torch.bfloat16
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    return _DTYPES.get(name, torch.bfloat16)


def format_scale_dtype(fmt: str, src: Path) -> torch.dtype:
    # GPTQ and AWQ store fp16 scales; llm-compressor stores the model's dtype. Quantizing with
    # the stored dtype makes the written scales exactly the ones the quantizer used.
    # bitsandbytes keeps fp32 absmax and records the model's dtype for readers to cast to.
    return source_dtype(src) if fmt in ("compressed-tensors", "bitsandbytes") else torch.float16


def pack_linear(lq: LinearQuant, fmt: str, spec: QuantSpec) -> dict[str, torch.Tensor]:
    qw = lq.qweight
    if spec.method == "fp8":  # compressed-tensors float-quantized: weight e4m3 + weight_scale
        from llmaccel.quant.formats.fp8 import pack_fp8

        return pack_fp8(qw)
    if spec.method == "nf4":  # weight (uint8 nibbles), weight.absmax, .quant_map, .quant_state
        return pack_bnb_nf4(qw, spec.scale_dtype)
    if fmt == "gptq":
        tensors = pack_gptq(qw, "gptq")
        if lq.g_idx is not None:
            tensors["g_idx"] = lq.g_idx.to(torch.int32)
        return tensors
    if fmt == "awq":
        return pack_awq(qw.codes, qw.scales, qw.zeros, spec.group_size, bits=spec.bits)
    return pack_compressed_tensors(qw.codes, qw.scales, None if qw.sym else qw.zeros,
                                   num_bits=spec.bits, group_size=spec.group_size,
                                   symmetric=qw.sym)


def quantization_config(fmt: str, spec: QuantSpec, lm_head: bool = False) -> dict[str, Any]:
    if spec.method == "fp8":
        from llmaccel.quant.formats.fp8 import fp8_quantization_config

        return fp8_quantization_config()
    if spec.method == "nf4":
        return bnb_quantization_config(spec.scale_dtype)
    if fmt == "gptq":
        return gptq_quantization_config(spec.bits, spec.group_size, spec.sym,
                                        desc_act=spec.act_order, lm_head=lm_head)
    if fmt == "awq":
        # Symmetric codes still carry qzeros (all 8), so the zero-point reader is always right.
        return awq_quantization_config(spec.group_size, zero_point=True, bits=spec.bits)
    return compressed_tensors_quantization_config(spec.bits, spec.group_size, spec.sym)


def _plain_tensors(hf: nn.Module, packed: dict[str, torch.Tensor], dtype: torch.dtype
                   ) -> dict[str, torch.Tensor]:
    quantized = {k.rsplit(".", 1)[0] for k in packed}  # module names of packed linears
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if (leaf == "weight" and module in quantized) or (tied and name == "lm_head.weight"):
            continue
        t = t.detach().cpu()
        # clone: safetensors refuses tensors that share storage (tied weights, views)
        out[name] = (t.to(dtype) if t.is_floating_point() else t).clone().contiguous()
    return out


def write_checkpoint(out_dir: Path, hf: nn.Module, src: Path, packed: dict[str, torch.Tensor],
                     qconfig: dict[str, Any], tokenizer: Any | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {**_plain_tensors(hf, packed, source_dtype(src)), **packed}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    if qconfig.get("lm_head"):
        # the quantized head is a layer of its own: a loader that tied it to the embedding
        # would drop the codes (vLLM unties nothing on its own)
        config["tie_word_embeddings"] = False
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", out_dir / "generation_config.json")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
