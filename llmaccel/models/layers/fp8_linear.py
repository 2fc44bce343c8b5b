"""FP8 W8A8 linear layers: E4M3 weights with per-channel scales, activations quantized per token.

`Fp8LinearMethod` registers the checkpoint's own tensors, `weight` (float8_e4m3fn [out, in]) and
`weight_scale` (fp32 [out, 1]); fused q/k/v and gate/up shards load into their rows, and a
per-tensor scale (vLLM fp8 checkpoints) is spread over its shard's rows, so one per-channel
layout serves both kinds of checkpoint.

`fp8_linear` computes, with x_q, s_x from `quantize_fp8_per_token`:

    y = (x_q @ W_q^T) * s_x * s_w^T  (+ bias)

On CUDA with compute capability 8.9 or newer (Ada, Hopper) the product is one
`torch._scaled_mm` with row-wise scales (fp8 tensor cores, fp32 accumulation, scales applied in
the epilogue). Elsewhere the reference path evaluates the same expression in fp32: products of
two e4m3 values are exact in fp32, so the two paths differ only in summation order and in the
output's rounding, which is what the GPU test bounds.
"""

from __future__ import annotations


from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from llmaccel.errors import CorruptCheckpointError
from llmaccel.kernels.l2_prefetch import layer_ranges
from llmaccel.models.layers.quantization import LinearMethodBase
from llmaccel.kernels.fp8_ref import FP8_DTYPE, fp8_linear_ref, quantize_fp8_per_token

# torch._scaled_mm checks that K and N (the weight's dims) are multiples of 16; M may be
# anything. A layer whose weight is not aligned runs the reference path.
SCALED_MM_ALIGN = 16
SCALED_MM_MIN_CAPABILITY = (8, 9)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@cache
def _scaled_mm_out_dtypes(device_index: int) -> frozenset[torch.dtype]:
    """Output dtypes `torch._scaled_mm` accepts with row-wise scales on this GPU: some torch
    builds take bf16 only. Found once per device by trying a 16x16 product, at load time (the
    first call must not happen inside CUDA-graph capture)."""
    if torch.cuda.get_device_capability(device_index) < SCALED_MM_MIN_CAPABILITY:
        return frozenset()
    dev = torch.device("cuda", device_index)
    a = torch.zeros(16, 16, device=dev, dtype=FP8_DTYPE)
    ones_a, ones_b = torch.ones(16, 1, device=dev), torch.ones(1, 16, device=dev)
    ok = set()
    for dtype in _OUT_DTYPES:
        try:
            torch._scaled_mm(a, a.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=dtype)
            ok.add(dtype)
        except (RuntimeError, NotImplementedError):
            pass
    return frozenset(ok)


def scaled_mm_dtypes(device: torch.device | str) -> frozenset[torch.dtype]:
    """Activation dtypes for which `torch._scaled_mm` runs the E4M3 product on `device`
    (CUDA, compute capability 8.9 or newer); empty elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return frozenset()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _scaled_mm_out_dtypes(index)


def supports_scaled_mm(device: torch.device | str, dtype: torch.dtype = torch.bfloat16
                       ) -> bool:
    """Whether `torch._scaled_mm` runs E4M3 products with `dtype` output on this device."""
    return dtype in scaled_mm_dtypes(device)


def _scaled_mm_rowwise(x_q: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                       w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # mat2 must be column-major: the row-major weight [N, K] transposed is exactly that, so no
    # copy. Row-wise scales: scale_a [M, 1], scale_b [1, N], both fp32.
    return torch._scaled_mm(x_q, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, -1),
                            out_dtype=out_dtype)


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, use_scaled_mm: bool | None = None
               ) -> torch.Tensor:
    """y = x W^T (+ bias) for W = w_fp8 [N, K] * w_scale [N, 1], with x [..., K] quantized to
    e4m3 per token. `use_scaled_mm` None picks `torch._scaled_mm` where the device supports it,
    False forces the fp32 reference, True forces `_scaled_mm` (the GPU test compares the two).
    The output has x's dtype; bias is added after the cast, in that dtype, on both paths."""
    if use_scaled_mm is None:
        use_scaled_mm = supports_scaled_mm(x.device, x.dtype) and _aligned(w_fp8)
    if not use_scaled_mm:
        return fp8_linear_ref(x, w_fp8, w_scale, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x_q, x_scale = quantize_fp8_per_token(x.reshape(-1, k))
    y = _scaled_mm_rowwise(x_q, x_scale, w_fp8, w_scale, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, w_fp8.shape[0])


@cache
def untuned_gemv_fp8():
    """The batch-1 FP8 GEMV tile for a shape the GPU's table does not hold."""
    from llmaccel.kernels.gemv_fp8 import GemvFp8Config

    # The H100 table's most frequent tile for the llama-3.2 / qwen2.5 shapes (4 rows by 1024
    # columns on 2 warps, the row quantized first by the norm or quantize_row_fp8): a guess
    # for another GPU, good on every H100 shape it was timed on.
    return GemvFp8Config(block_n=4, block_k=1024, num_warps=2, num_stages=3, prequant=True)


@cache
def _triton_fp8(device: torch.device) -> bool:
    """Triton is installed and compiles e4m3 on this device (asked once per device: `apply`
    checks it on every one-row call)."""
    from llmaccel.kernels import triton_available, triton_supports_fp8

    return triton_available() and triton_supports_fp8(device)


def _gemv_config(layer: nn.Module):
    """The batch-1 FP8 GEMV tile for this layer's shape: the GPU table's (benchmarks/
    bench_fp8_gemv.py; the lookup is cached), else on CUDA `untuned_gemv_fp8()`; None where
    Triton cannot run e4m3 here, and off CUDA without a table entry (the interpreter is no
    fast path). The GEMV beat `torch._scaled_mm` on all 12 shapes measured on an H100 (1.2-5x), so a shape or a GPU without an entry takes it too:
    before, an untuned H200 ran FP8 decode steps 1.7x slower than bf16."""
    if not Fp8LinearMethod._gemv_ok(layer):
        return None
    from llmaccel.kernels.gemm_tuning import gemv_fp8_config

    tuned = gemv_fp8_config(layer.output_size, layer.input_size, layer.weight.device)
    return tuned or (untuned_gemv_fp8() if layer.weight.is_cuda else None)


# Batch-1 FP8 products on the CUDA C GEMV (`kernels/gemv_fp8_cuda.py`) where CUDA C kernels
# run. Its CUDA-core kernel (csrc/gemv_fp8_cc.cu) streamed a llama-3.2-3b layer's four GEMVs at
# 2.67 TB/s against the Triton GEMV's 2.0, and W1 FP8 ran 572 against 495 tok/s on an H100.


def _cuda_gemv(layer: nn.Module, x: torch.Tensor) -> bool:
    """This one-row product can take the CUDA C FP8 GEMV."""
    if not layer.weight.is_cuda or x.numel() != x.shape[-1]:
        return False
    from llmaccel.kernels.gemv_fp8_cuda import supports

    return supports(x, layer.weight, layer.weight_scale)


def _cuda_gemv_possible(layer: nn.Module) -> bool:
    """For choices made before x exists (and the log): bf16 activations assumed."""
    if not layer.weight.is_cuda:
        return False
    x = torch.empty(layer.input_size, dtype=torch.bfloat16, device=layer.weight.device)
    return _cuda_gemv(layer, x)


def _aligned(w_fp8: torch.Tensor) -> bool:
    return w_fp8.shape[0] % SCALED_MM_ALIGN == 0 and w_fp8.shape[1] % SCALED_MM_ALIGN == 0


def _shard_rows(param: nn.Parameter, output_sizes: list[int], shard_id: int | None
                ) -> torch.Tensor:
    if shard_id is None:
        return param.data
    return param.data.narrow(0, sum(output_sizes[:shard_id]), output_sizes[shard_id])


def _weight_loader(output_sizes: list[int]) -> Callable[..., None]:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        # Linear.weight_loader's own copy_ would convert any float or int tensor into e4m3
        # without a word; a bf16 or int8 `weight` here means the file is not what its config
        # says.
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"fp8 weight must be {FP8_DTYPE}, got {loaded.dtype}")
        rows = _shard_rows(param, output_sizes, shard_id)
        if tuple(rows.shape) != tuple(loaded.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(rows.shape)}")
        rows.copy_(loaded)

    return load


def _scale_loader(output_sizes: list[int], strategy: str) -> Callable[..., None]:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        if not loaded.is_floating_point() or loaded.element_size() == 1:
            raise ValueError(f"weight_scale must be fp32/bf16/fp16, got {loaded.dtype}")
        rows = _shard_rows(param, output_sizes, shard_id)
        if strategy == "tensor":
            if loaded.numel() != 1 or loaded.dim() > 2:
                raise ValueError(f"per-tensor weight_scale must hold one value, got shape "
                                 f"{tuple(loaded.shape)}")
            # one scale per shard, spread over its rows: fused q/k/v keep their own scales
            rows.copy_(loaded.reshape(1, 1).expand_as(rows))
            return
        if tuple(loaded.shape) != tuple(rows.shape):
            raise ValueError(f"per-channel weight_scale shape {tuple(loaded.shape)} does not "
                             f"fit {tuple(rows.shape)} (out, 1)")
        rows.copy_(loaded)

    return load


def _param(shape: tuple[int, ...], dtype: torch.dtype,
           loader: Callable[..., None]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.output_dim = 0
    p.weight_loader = loader
    return p


class Fp8LinearMethod(LinearMethodBase):
    """weight float8_e4m3fn [out, in], weight_scale fp32 [out, 1]; dynamic per-token x."""

    def __init__(self, weight_strategy: str = "channel") -> None:
        self.weight_strategy = weight_strategy  # the checkpoint's: "channel" or "tensor"
        # activation dtypes that take _scaled_mm; set once the weights are on their device
        self.mm_dtypes: frozenset[torch.dtype] = frozenset()

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        out = sum(output_sizes)
        layer.register_parameter("weight", _param((out, input_size), FP8_DTYPE,
                                                  _weight_loader(output_sizes)))
        layer.register_parameter("weight_scale", _param(
            (out, 1), torch.float32, _scale_loader(output_sizes, self.weight_strategy)))

    @torch.no_grad()
    def init_dummy_weights(self, layer: nn.Module) -> None:
        """Dummy weights (speed runs) the shape of real ones: e4m3 codes over most of their
        range and a positive per-channel scale, so weight * scale has the loader's
        uniform(-b, b) spread (the generic init draws the scale from +-b, negative too)."""
        w = layer.weight.data
        gen = torch.Generator(device=w.device).manual_seed(w.numel())
        codes = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        w.copy_(codes.uniform_(-448.0, 448.0, generator=gen))
        bound = float(layer.weight_scale.data.abs().max().clamp_min(1e-3))
        layer.weight_scale.data.fill_(bound / 448.0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # 0x7F / 0xFF are e4m3's NaNs: checked on the raw bytes, without a float copy
        nan = (layer.weight.data.view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            raise CorruptCheckpointError(f"{layer.prefix}.weight holds e4m3 NaN codes")
        scale = layer.weight_scale.data
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise CorruptCheckpointError(f"{layer.prefix}.weight_scale must be finite and "
                                         "non-negative")
        if _aligned(layer.weight):
            self.mm_dtypes = scaled_mm_dtypes(layer.weight.device)

    def apply(self, layer, x, bias=None):
        if getattr(layer, "use_triton", False) and x.numel() == x.shape[-1]:
            if _cuda_gemv(layer, x):  # batch-1 decode: the CUDA C GEMV, row quantized first
                from llmaccel.kernels.gemv_fp8 import quantize_row_fp8
                from llmaccel.kernels.gemv_fp8_cuda import fp8_gemv_cuda

                x_q, x_scale = quantize_row_fp8(x)
                return fp8_gemv_cuda(x_q, x_scale, layer.weight, layer.weight_scale, bias,
                                     prefetch=layer_ranges(layer))
            cfg = _gemv_config(layer)
            if cfg is not None:  # batch-1 decode: the GEMV
                from llmaccel.kernels.gemv_fp8 import fp8_gemv

                return fp8_gemv(x, layer.weight, layer.weight_scale, bias, cfg)
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, x.dtype in self.mm_dtypes)

    def apply_silu_out(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                       x_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """silu_and_mul(layer(x)) for one row of a [gate; up] layer in the batch-1 GEMV (the
        activation in its epilogue), or None where `apply` would not take the GEMV. With
        `x_scale`, x is the row quantized already (as for `apply_quantized`)."""
        if getattr(layer, "use_triton", False) and _cuda_gemv(layer, x):
            from llmaccel.kernels.gemv_fp8 import quantize_row_fp8
            from llmaccel.kernels.gemv_fp8_cuda import fp8_gemv_cuda

            if x_scale is None:
                x, x_scale = quantize_row_fp8(x)
            return fp8_gemv_cuda(x, x_scale, layer.weight, layer.weight_scale, bias,
                                 silu_out=True, prefetch=layer_ranges(layer))
        cfg = _gemv_config(layer)
        if cfg is None or cfg.block_n < 2:
            return None
        from llmaccel.kernels.gemv_fp8 import fp8_gemv

        return fp8_gemv(x, layer.weight, layer.weight_scale, bias, cfg, silu_out=True,
                        x_scale=x_scale)

    def wants_quantized_input(self, layer: nn.Module) -> bool:
        """Whether a one-row product runs the GEMV on a row quantized first (a prequant tile):
        then the RMSNorm before it can quantize the row itself (`rmsnorm.rms_norm_fp8`) and
        hand it to `apply_quantized`, one kernel fewer."""
        if not getattr(layer, "use_triton", False):
            return False
        if _cuda_gemv_possible(layer):
            return True
        cfg = _gemv_config(layer)
        return cfg is not None and cfg.prequant

    def apply_quantized(self, layer: nn.Module, x_q: torch.Tensor, x_scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """layer(x) for one row given as its e4m3 values `x_q` (in x's dtype) and fp32 scale
        [1], as `quantize_fp8_per_token` makes them: the GEMV without its own quantization."""
        if _cuda_gemv(layer, x_q):
            from llmaccel.kernels.gemv_fp8_cuda import fp8_gemv_cuda

            return fp8_gemv_cuda(x_q, x_scale, layer.weight, layer.weight_scale, bias,
                                 prefetch=layer_ranges(layer))
        from llmaccel.kernels.gemv_fp8 import fp8_gemv

        return fp8_gemv(x_q, layer.weight, layer.weight_scale, bias, _gemv_config(layer),
                        x_scale=x_scale)

    def fused_decode_config(self, layer: nn.Module, m: int, kind: str):
        """The FP8 GEMV tile for a fused decode layer (norm / SiLU-and-mul / residual folded
        into `kernels/gemv_fp8.py`), or None: one row, and a tile for this fusion in the GPU's
        table, which benchmarks/tune_fused_decode_quant.py writes only where the fused chain
        measured faster than the unfused one."""
        if m != 1 or not kind or not self._gemv_ok(layer):
            return None
        from llmaccel.kernels.gemm_tuning import fused_fp8_config

        return fused_fp8_config(kind, layer.output_size, layer.input_size, layer.weight.device)

    def apply_fused(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                    config, **fusion) -> torch.Tensor:
        from llmaccel.kernels.gemv_fp8 import fp8_gemv

        return fp8_gemv(x, layer.weight, layer.weight_scale, bias, config, **fusion)

    @staticmethod
    def _gemv_ok(layer: nn.Module) -> bool:
        return _triton_fp8(layer.weight.device)

    def describe(self, layer: nn.Module | None = None) -> str:
        gemv = ""
        if layer is not None and getattr(layer, "use_triton", False):
            if _cuda_gemv_possible(layer):
                from llmaccel.kernels.gemv_fp8_cuda import chosen_config

                cfg = chosen_config(layer.output_size, layer.input_size)
                where = ("on the CUDA cores (kernels/csrc/gemv_fp8_cc.cu" if cfg.cc_rows else
                         "on the tensor cores (kernels/csrc/gemv_fp8.cu")
                gemv = f"; batch 1: CUDA C FP8 GEMV {where} via NVRTC, tile {cfg.describe()})"
            elif _gemv_config(layer) is not None:
                from llmaccel.kernels.gemm_tuning import gemv_fp8_config

                tuned = gemv_fp8_config(layer.output_size, layer.input_size, layer.weight.device)
                tile = "default" if tuned is None else "tuned"
                gemv = f"; batch 1: Triton FP8 GEMV (kernels/gemv_fp8.py, {tile} tile)"
            if self.fused_decode_config(layer, 1, "norm") is not None:
                gemv += ("; fused decode layers at batch 1: the GEMV with the norm, "
                         "SiLU-and-mul and residual add folded in")
        if not self.mm_dtypes:
            kernel = "reference"
        elif self.mm_dtypes == frozenset(_OUT_DTYPES):
            kernel = "torch._scaled_mm"
        else:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.mm_dtypes))
            kernel = f"torch._scaled_mm for {names}; reference otherwise"
        return f"fp8 W8A8 per-{self.weight_strategy}/per-token ({kernel}{gemv})"


__all__ = ["Fp8LinearMethod", "fp8_linear", "scaled_mm_dtypes", "supports_scaled_mm"]
