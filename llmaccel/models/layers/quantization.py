"""The quantization-method interface through which every linear layer is built.

A `QuantizationConfig` (RTN, GPTQ, AWQ, FP8 ... in `llmaccel.quant`) hands each linear layer a
`LinearMethodBase`; the method creates the layer's parameters (`create_weights`) and computes
the product (`apply`). The model definition stays the same for bf16, int8, int4 and FP8.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethodBase(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the layer's parameters. Each parameter carries `output_dim` (the axis the
        fused output shards are stacked on) so the loader can place q/k/v or gate/up shards."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, input_size] -> [T, sum(output_sizes)]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack loaded weights for the kernel (no-op for plain weights)."""


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype),
                              requires_grad=False)
        weight.output_dim = 0
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        return dense_linear(x, layer.weight, bias, getattr(layer, "use_triton", False))


# Rows up to which a decode-size product may take the Triton GEMV (kernels/gemm.py).
DENSE_GEMV_MAX_ROWS = 16


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 use_triton: bool = False) -> torch.Tensor:
    """F.linear, except for decode-size products on CUDA whose shape the GPU's tuning table
    (kernels/gemm_tuning.py) measured faster through the Triton kernel than through cuBLAS."""
    if (use_triton and x.is_cuda and x.dim() == 2 and x.shape[0] <= DENSE_GEMV_MAX_ROWS
            and weight.element_size() == 2):  # the table's tiles are sized for 16-bit weights
        from llmaccel.kernels.gemm import triton_linear
        from llmaccel.kernels.gemm_tuning import dense_config

        cfg = dense_config(x.shape[0], weight.shape[0], weight.shape[1], x.device)
        if cfg is not None:
            return triton_linear(x, weight, 16, bias=bias, config=cfg)
    return F.linear(x, weight, bias)


# Rows up to which a decoder layer may run fused (norm and SiLU folded into its GEMVs, the
# residual add into their epilogues; `DecoderLayer.forward_fused`).
FUSED_DECODE_MAX_ROWS = 16


def fused_gemv_config(layer: nn.Module, m: int, kind: str):
    """The Triton GEMV config for `m` rows of a dense Linear in a fused decode layer, or None
    when the layer cannot take the fused kernel (Triton off, too many rows, a quantized method
    without a fused GEMV for this many rows: see `fused_decode_config` of PackedLinearMethod and
    Fp8LinearMethod). `kind`
    names the fusion ("norm", "res", "silu"; see kernels/gemm_tuning.fused_key). A 16-bit CUDA
    layer fuses only at one row, with the tile tuned for it in the chain
    (benchmarks/tune_fused_decode.py) or else its dense batch-1 tile; other layers (fp32
    references, the interpreter) take the heuristic tile."""
    if m > FUSED_DECODE_MAX_ROWS or not getattr(layer, "use_triton", False):
        return None
    if not isinstance(layer.quant_method, UnquantizedLinearMethod):
        # a quantized method fuses where it has a GEMV with the same prologues and epilogue
        method_config = getattr(layer.quant_method, "fused_decode_config", None)
        return None if method_config is None else method_config(layer, m, kind)
    from llmaccel.kernels.gemm import pick_config
    from llmaccel.kernels.gemm_tuning import fused_config

    n, k = layer.weight.shape
    # The tables were tuned on 16-bit weights: a tile sized for them can need twice the shared
    # memory the GPU has with fp32 weights (fp32 runs are references, not the fast path).
    tuned = layer.weight.is_cuda and layer.weight.element_size() == 2
    if tuned:
        # Only a tile measured for this row count: untuned fused tiles at 2-16 rows ran whole
        # decode steps 2-3.6x slower than one row on an H100 (qwen2.5-1.5b:
        # 1 row 1.9 ms, 2-8 rows 6.0 ms, 32 rows through cuBLAS 2.1 ms), and
        # every speculative verify step has k + 1 rows per sequence.
        return fused_config(kind, m, n, k, layer.weight.device)
    return pick_config(m, n, k, 16, -1)


def fused_linear(layer: nn.Module, x: torch.Tensor, config, **fusion) -> torch.Tensor:
    """Run `layer` in a fused decode layer with the config `fused_gemv_config` gave; `fusion`
    is `norm_weight`/`eps`, `silu` or `residual` as in kernels/gemm.triton_linear."""
    if isinstance(layer.quant_method, UnquantizedLinearMethod):
        from llmaccel.kernels.gemm import triton_linear

        return triton_linear(x, layer.weight, bias=layer.bias, config=config, **fusion)
    return layer.quant_method.apply_fused(layer, x, layer.bias, config, **fusion)


def gate_up_silu(layer: nn.Module, x: torch.Tensor,
                 x_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu_and_mul(layer(x)) in one kernel, for a [gate; up] layer whose quantized method has
    a batch-1 GEMV with the activation in its epilogue (`apply_silu_out`); None where it has
    none (more than one row, Triton off, no tuned GEMV for the shape), and the caller runs the
    two steps. With `x_scale` x is the row FP8-quantized already (`QuantizedRow`)."""
    if (not getattr(layer, "use_triton", False)
            or x.numel() != x.shape[-1] or len(layer.output_sizes) != 2
            or layer.output_sizes[0] != layer.output_sizes[1]):
        return None
    apply_silu_out = getattr(layer.quant_method, "apply_silu_out", None)
    return None if apply_silu_out is None else apply_silu_out(layer, x, layer.bias, x_scale)


def qkv_rope(layer: nn.Module, x: torch.Tensor, rope) -> torch.Tensor | None:
    """q for one decode token of a [q; k; v] layer whose quantized method has a batch-1 GEMV
    with rope and the K/V cache write in its epilogue (`apply_qkv_rope`; `rope` is a
    `kernels.gemv_w4_cuda.RopeCache`), the rotated k and v written to the cache; None where
    it has none, and the caller runs the GEMV, then rope and the cache write."""
    if (not getattr(layer, "use_triton", False)
            or not isinstance(x, torch.Tensor) or x.numel() != x.shape[-1]):
        return None
    apply_qkv_rope = getattr(layer.quant_method, "apply_qkv_rope", None)
    return None if apply_qkv_rope is None else apply_qkv_rope(layer, x, layer.bias, rope)


@dataclass
class QuantizedRow:
    """One normalized row as e4m3 values (in the activation dtype) and its fp32 scale [1]:
    what `rmsnorm.rms_norm_fp8` hands an FP8 GEMV in place of the normalized row."""
    q: torch.Tensor
    scale: torch.Tensor


def wants_quantized_row(norm: nn.Module, layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `norm` should quantize its output row for `layer` (one row, Triton kernels on,
    and `layer`'s method runs that product as a GEMV on a quantized row)."""
    if x.numel() != x.shape[-1] or not getattr(norm, "use_triton", False):
        return False
    wants = getattr(layer.quant_method, "wants_quantized_input", None)
    return wants is not None and wants(layer)


def linear_on(layer: nn.Module, x: torch.Tensor | QuantizedRow) -> torch.Tensor:
    """layer(x), for a plain input or a `QuantizedRow`."""
    if isinstance(x, QuantizedRow):
        return layer.quant_method.apply_quantized(layer, x.q, x.scale, layer.bias)
    return layer(x)


class QuantizationConfig(ABC):
    """Names a quantization scheme and hands out a linear method per layer prefix."""

    name: str = "none"
    # whether the checkpoint quantized lm_head too (GPTQ's `lm_head: true`); the model then
    # builds its head through `get_linear_method("lm_head")`, as a separate (untied) layer
    quantizes_lm_head: bool = False

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        ...

    def checkpoint_weights(self, weights: Iterator[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) pairs under the names our parameters have. Most
        formats need no renaming; bitsandbytes' dotted side tensors ("weight.absmax") do."""
        return weights
