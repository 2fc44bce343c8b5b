"""Linear methods that run packed GPTQ / AWQ / compressed-tensors weights inside our Transformer.

Each method registers the checkpoint's own tensors (same names, shapes and dtypes as on disk, so
`TransformerForCausalLM.load_weights` fills them shard by shard like plain weights), then
`process_weights_after_loading` unpacks them once into one layout shared by all three formats:

    codes   uint8 [out, in]        unsigned codes, one per weight
    scales  fp32  [out, n_groups]  fp32 holds fp16 and bf16 scales exactly
    zeros   int32 [out, n_groups]  the zero point readers use (GPTQ v1's +1 already applied)
    g_idx   int64 [n_idx, in]      group of each input channel; one row per fused shard when the
                                   shards' act-order permutations differ, else a single row

On CUDA with Triton, `process_weights_after_loading` then repacks that layout once more for
`kernels/gemm.py` (int4 eight to an int32 along K, act-order channels sorted into contiguous
groups, scales in the activation dtype when exact) and drops the unpacked copy; `apply` runs the
Triton W4A16/W8A16 kernel with a per-shape config from the GPU's tuning table. Everywhere else
`apply` is the reference path: W = (codes - zeros[:, g]) * scales[:, g] in fp32, cast to the
activation dtype, then F.linear; exact but re-dequantized on every call, so it is for CPU and
for checking the kernel. The engine logs which of the two each layer uses.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.errors import CorruptCheckpointError
from llmaccel.kernels import triton_available
from llmaccel.kernels.l2_prefetch import layer_ranges
from llmaccel.models.layers.quantization import LinearMethodBase
from llmaccel.models.layers.packed_formats import (AWQ_PACK_FACTOR, ZERO_OFFSETS, pack_factor,
                                                   unpack_awq, unpack_compressed_tensors,
                                                   unpack_int32)


def _param(shape: tuple[int, ...], dtype: torch.dtype, output_dim: int | None = None,
           packed_factor: int = 1) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    if output_dim is not None:
        p.output_dim = output_dim
        p.packed_factor = packed_factor  # Linear.weight_loader divides shard offsets by this
    return p


def _per_shard_loader(what: str):
    """A weight_loader for a tensor that each fused shard carries whole (g_idx, weight_shape):
    the parameter keeps one row per shard instead of one stacked slice."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        row = param.data[0 if shard_id is None else shard_id]
        if tuple(row.shape) != tuple(loaded.shape):
            raise ValueError(f"{what} shape {tuple(loaded.shape)} does not fit "
                             f"{tuple(row.shape)}")
        row.copy_(loaded)

    return load


def dequantize_unpacked(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        g_idx: torch.Tensor, output_sizes: list[int],
                        dtype: torch.dtype) -> torch.Tensor:
    """W [out, in] in `dtype` from the unpacked layout (see the module docstring)."""
    if g_idx.shape[0] == 1:
        return _dequant_rows(codes, scales, zeros, g_idx[0]).to(dtype)
    parts, start = [], 0
    for shard, size in enumerate(output_sizes):
        rows = slice(start, start + size)
        parts.append(_dequant_rows(codes[rows], scales[rows], zeros[rows], g_idx[shard]))
        start += size
    return torch.cat(parts).to(dtype)


def _dequant_rows(codes, scales, zeros, g_idx) -> torch.Tensor:
    out, k = codes.shape
    n_groups = scales.shape[1]
    if k % n_groups == 0 and _contiguous_groups(g_idx, k // n_groups):
        # groups of consecutive channels (no act-order): broadcast each group's scale and
        # zero over a [out, groups, size] view instead of gathering [out, in] copies of them
        size = k // n_groups
        # (the same arithmetic as below: integer differences are exact in fp32, then one
        # rounding in the product)
        w = codes.view(out, n_groups, size).to(torch.float32)
        w.sub_(zeros.unsqueeze(-1).to(torch.float32)).mul_(scales.unsqueeze(-1))
        return w.view(out, k)
    q = codes.to(torch.int32) - zeros[:, g_idx]
    return q.to(torch.float32) * scales[:, g_idx]


def _contiguous_groups(g_idx: torch.Tensor, size: int) -> bool:
    expected = torch.arange(g_idx.numel(), device=g_idx.device) // size
    return bool(torch.equal(g_idx, expected))


def _gemv_w4_config(layer: nn.Module, k: int, device: torch.device):
    """The batch-1 GEMV tile for this layer's shape: the GPU table's (benchmarks/
    bench_w4_gemv.py), else the default tile; None off CUDA. The GEMV beat the general kernel
    on every shape measured (1.05-2.8x on an H100), so a shape or a
    GPU without an entry takes it too: before, they took the general kernel, and an untuned
    H200 ran int4 decode steps 3.5x slower than bf16."""
    if not layer.kernel_weight.is_cuda:
        return None
    from llmaccel.kernels.gemm_tuning import gemv_w4_config
    from llmaccel.kernels.gemv_w4 import default_gemv_w4_config

    return (gemv_w4_config(layer.output_size, k, layer.kernel_group_size, device)
            or default_gemv_w4_config(layer.output_size, k, layer.kernel_group_size))




# Batches of this many rows or more dequantize the layer's weight to the activation dtype
# (one memory-bound kernel, `gemm.dequantize_packed`) and run cuBLAS, per bit width. On an
# H100, over a llama-3.2-3b layer's four shapes, against the fused Triton GEMM with the table's
# tiles:
# - int4: 1.04x at 16 rows, 1.57x at 32, 1.61x at 128, 4.2x at 512;
# - int8: 0.80x at 32 and 0.77x at 128, 1.18x at 256, 1.68x at 512.
DEQUANT_GEMM_MIN_M = {4: 32, 8: 256}


# Batches of 2 to W4_GEMM_MAX_M rows take the tensor-core W4A16 GEMM in CUDA C
# (`kernels/gemm_w4_cuda.py`), which reads the codes directly, where it can run; above it (and
# where it cannot) the dequantize + cuBLAS pair or the Triton kernel, as before. On the
# llama-3.2-3b shapes (H100) it ran 1.3-2.6x the Triton kernel at 2-16 rows, a layer's four
# products in 174 us against 183 for dequantize + cuBLAS at 128 rows (W1's int4 TTFT 7.0 ->
# 6.7 ms), and 286 against 200 us at 256 rows.
W4_GEMM_MAX_M = 128
# From this many rows, layers of at most W4_GEMM_NARROW_N columns take dequantize + cuBLAS
# instead: their tiles give the GEMM few blocks. The LEAN tiles against the pair at 128 rows,
# same call (H100), us: qkv (5120 columns) 28.6 vs
# 23.1, o (3072) 20.2 vs 18.1, down (3072) 51.3 vs 48.6; gate_up (16384) 49.7 vs 93.6. At 64
# rows the GEMM won on all four (20.3 vs 22.7 ... 33.1 vs 44.3); 65-127 rows were not
# measured, so they keep it.
W4_GEMM_NARROW_MIN_M = 128
W4_GEMM_NARROW_N = 8192


# From W4_WGMMA_MIN_M to W4_WGMMA_MAX_M rows, int4 layers on an sm_90 GPU take the wgmma W4A16
# GEMM (`kernels/gemm_w4_wgmma.py`) where it can run (K and the group multiples of its 64-k
# step, or per channel), before the mma.sync GEMM and dequantize + cuBLAS. H100,
# llama-3.2-3b shapes, fp32 scales as the engine keeps GPTQ's fp16 ones, us (mma.sync GEMM /
# dequantize + cuBLAS / wgmma): 64 rows qkv
# 21.0 / 22.9 / 15.8, o 13.5 / 15.8 / 13.9, gate_up 33.6 / 92.9 / 23.0, down 32.6 / 44.7 /
# 25.4; 128 rows qkv 29.4 / 23.5 / 22.2, o 20.6 / 18.6 / 15.5, gate_up 48.9 / 94.5 / 33.7, down
# 52.0 / 49.0 / 43.6; 256 rows qkv 47.3 / 30.4 / 32.7, o 28.8 / 19.7 / 21.9, gate_up 93.1 / 98.3
# / 44.1, down 73.6 / 54.4 / 53.0 (a layer's four: 200 / 203 / 152). Below 64 rows (32: level
# with the mma.sync GEMM) and above 256 it was not chosen or not measured.
W4_WGMMA_MIN_M = 64
W4_WGMMA_MAX_M = 256


def _kernel_takes(layer: nn.Module, kernel: str, x2: torch.Tensor,
                  bias: torch.Tensor | None) -> bool:
    """Whether `kernels.<kernel>.supports` takes this layer's calls, decided once per layer,
    activation dtype and bias: the weights never change after loading, so the checks (tensor
    queries, the device's CUDA C support) need not run per call. The kernels' tile choice
    keeps the answer the same for every row count."""
    cache = layer.__dict__.setdefault(f"_{kernel}_ok", {})
    key = (x2.dtype, x2.shape[-1], bias is None)
    ok = cache.get(key)
    if ok is None:
        import importlib

        supports = importlib.import_module(f"llmaccel.kernels.{kernel}").supports
        ok = cache[key] = bool(layer.kernel_weight.is_cuda and supports(
            x2, layer.kernel_weight, layer.kernel_scales, layer.kernel_zeros,
            layer.kernel_group_size, bias))
    return ok


def _use_w4_wgmma(layer: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (W4_WGMMA_MIN_M <= x2.shape[0] <= W4_WGMMA_MAX_M
            and _kernel_takes(layer, "gemm_w4_wgmma", x2, bias))


def _use_w4_gemm(layer: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if not 2 <= x2.shape[0] <= W4_GEMM_MAX_M:
        return False
    if x2.shape[0] >= W4_GEMM_NARROW_MIN_M and layer.output_size <= W4_GEMM_NARROW_N:
        return False
    return _kernel_takes(layer, "gemm_w4_cuda", x2, bias)


def _use_cuda_gemv(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Batch-1 int4 layers take the CUDA C GEMV (`kernels/gemv_w4_cuda.py`) where it can run:
    on an H100 it streamed a llama-3.2-3b layer's four GEMVs in 29 us against the Triton
    GEMV's 43. LLMACCEL_CUDA_KERNELS=0 turns it off."""
    if not layer.kernel_weight.is_cuda:
        return False
    from llmaccel.kernels.gemv_w4_cuda import supports

    return supports(x, layer.kernel_weight, layer.kernel_scales, layer.kernel_zeros,
                    layer.kernel_group_size, bias)


def _cuda_gemv_available(layer: nn.Module) -> bool:
    """For the log: whether this layer's batch-1 calls will take the CUDA C GEMV (bf16/fp16
    activations assumed: the model's dtype)."""
    if not layer.kernel_weight.is_cuda:
        return False
    dt = torch.bfloat16 if layer.kernel_scales.dtype == torch.float32 else \
        layer.kernel_scales.dtype
    x = torch.empty(layer.input_size, device=layer.kernel_weight.device, dtype=dt)
    return _use_cuda_gemv(layer, x, None)


def _w4_gemm_available(layer: nn.Module) -> bool:
    """For the log: whether this layer's 2+-row calls will take the tensor-core GEMM."""
    if not layer.kernel_weight.is_cuda:
        return False
    dt = torch.bfloat16 if layer.kernel_scales.dtype == torch.float32 else \
        layer.kernel_scales.dtype
    x = torch.empty(2, layer.input_size, device=layer.kernel_weight.device, dtype=dt)
    return _use_w4_gemm(layer, x, None)


def _w4_wgmma_available(layer: nn.Module) -> bool:
    """For the log: whether this layer's prefill-sized calls will take the wgmma GEMM."""
    if not (layer.kernel_weight.is_cuda and W4_WGMMA_MIN_M <= W4_WGMMA_MAX_M):
        return False
    dt = torch.bfloat16 if layer.kernel_scales.dtype == torch.float32 else \
        layer.kernel_scales.dtype
    x = torch.empty(W4_WGMMA_MIN_M, layer.input_size, device=layer.kernel_weight.device,
                    dtype=dt)
    return _use_w4_wgmma(layer, x, None)


def _qkv_layer(layer: nn.Module) -> bool:
    """A fused [q; k; v] projection (for the log: it takes the rope epilogue at decode)."""
    return (len(getattr(layer, "output_sizes", ())) == 3
            and getattr(layer, "prefix", "").endswith("qkv_proj"))


def _gate_up_layer(layer: nn.Module) -> bool:
    sizes = getattr(layer, "output_sizes", ())
    return len(sizes) == 2 and sizes[0] == sizes[1]


def _tuned_w4(layer: nn.Module) -> bool:
    """Whether the GPU's table holds a batch-1 GEMV tile for this layer (for the log)."""
    from llmaccel.kernels.gemm_tuning import gemv_w4_config

    return gemv_w4_config(layer.output_size, layer.input_size, layer.kernel_group_size,
                          layer.kernel_weight.device) is not None


class PackedLinearMethod(LinearMethodBase):
    """Shared part: the unpacked layout, the reference `apply`, a description for the log."""

    format_name = "packed"

    def __init__(self, bits: int, group_size: int, sym: bool) -> None:
        self.bits, self.group_size, self.sym = bits, group_size, sym

    def describe(self, layer: nn.Module | None = None) -> str:
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        kind = "sym" if self.sym else "asym"
        if layer is not None and hasattr(layer, "kernel_weight") and layer.use_triton:
            order = ", act-order permuted" if layer.kernel_perm is not None else ""
            kernel = f"Triton W{self.bits}A16 (kernels/gemm.py{order})"
            if self.bits == 4 and _cuda_gemv_available(layer):
                from llmaccel.kernels.gemv_w4_cuda import tile_for

                cfg, tuned = tile_for(layer.output_size, layer.input_size,
                                      layer.kernel_weight.device)
                kernel += (f"; batch 1: CUDA C W4A16 GEMV (kernels/csrc/gemv_w4.cu via NVRTC, "
                           f"{'tuned' if tuned else 'default'} tile {cfg.describe()}"
                           + (", rope and the K/V cache write in its epilogue"
                              if _qkv_layer(layer) else "")
                           + (", SiLU-and-mul in its epilogue" if _gate_up_layer(layer)
                              else "") + ")")
            elif self.bits == 4 and _gemv_w4_config(layer, layer.input_size,
                                                    layer.kernel_weight.device) is not None:
                tuned = _tuned_w4(layer)
                kernel += (f"; batch 1: Triton W4A16 GEMV (kernels/gemv_w4.py, "
                           f"{'tuned' if tuned else 'default'} tile)")
            wgmma = self.bits == 4 and _w4_wgmma_available(layer)
            w4_gemm = self.bits == 4 and _w4_gemm_available(layer)
            if w4_gemm:
                top = (W4_GEMM_MAX_M if layer.output_size > W4_GEMM_NARROW_N
                       else min(W4_GEMM_MAX_M, W4_GEMM_NARROW_MIN_M - 1))
                if wgmma:
                    top = min(top, W4_WGMMA_MIN_M - 1)
                kernel += (f"; 2-{top} rows: CUDA C tensor-core W4A16 GEMM "
                           "(kernels/csrc/gemm_w4.cu, tile by rows and columns)")
            if wgmma:
                kernel += (f"; {W4_WGMMA_MIN_M}-{W4_WGMMA_MAX_M} rows: CUDA C wgmma W4A16 GEMM "
                           "(kernels/csrc/gemm_w4_wgmma.cu, sm_90a, tile by rows and columns)")
            min_m = DEQUANT_GEMM_MIN_M.get(self.bits, 0)
            if min_m:
                if wgmma:
                    min_m = max(min_m, W4_WGMMA_MAX_M + 1)
                elif w4_gemm:
                    min_m = max(min_m, top + 1)
                kernel += (f"; from {min_m} rows: dequantize (kernels/gemm.py "
                           "dequantize_packed) + cuBLAS")
            if self.fused_decode_config(layer, 1, "norm") is not None:
                kernel += ("; fused decode layers at batch 1: the GEMV with the norm, "
                           "SiLU-and-mul and residual add folded in")
        else:
            kernel = ("reference: dequantize + F.linear" if layer is None or not
                      hasattr(layer, "kernel_weight") else "reference on the kernel layout")
        return f"{self.format_name} int{self.bits} {group} {kind} ({kernel})"

    def init_dummy_weights(self, layer: nn.Module) -> None:
        """After random dummy values: the index tensors a real checkpoint would hold (groups in
        input order, the true shapes), so random codes load like a checkpoint."""
        if hasattr(layer, "g_idx"):
            group = self._group_len(layer.input_size, layer.prefix)
            layer.g_idx.data.copy_(torch.arange(layer.input_size) // group)
        if hasattr(layer, "weight_shape"):
            for row, size in zip(layer.weight_shape.data, layer.output_sizes):
                row.copy_(torch.tensor([size, layer.input_size]))

    def _group_len(self, input_size: int, prefix: str) -> int:
        group = input_size if self.group_size == -1 else self.group_size
        if input_size % group:
            raise CorruptCheckpointError(f"{prefix}: in_features={input_size} is not a multiple "
                                         f"of the checkpoint's group_size={self.group_size}")
        return group

    def _set_unpacked(self, layer: nn.Module, packed: tuple[str, ...], codes: torch.Tensor,
                      scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> None:
        for name in packed:
            delattr(layer, name)
        if g_idx.dim() == 1:
            g_idx = g_idx[None]
        if g_idx.shape[0] > 1 and bool((g_idx == g_idx[:1]).all()):
            g_idx = g_idx[:1]  # fused shards share one input, so usually one ordering
        n_groups = scales.shape[1]
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups):
            raise CorruptCheckpointError(f"{layer.prefix}.g_idx holds groups outside "
                                         f"0..{n_groups - 1}")
        for name, t in (("codes", codes.to(torch.uint8)), ("scales", scales.to(torch.float32)),
                        ("zeros", zeros.to(torch.int32)), ("g_idx", g_idx.to(torch.int64))):
            layer.register_parameter(name, nn.Parameter(t.contiguous(), requires_grad=False))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        try:
            self._unpack(layer)
        except CorruptCheckpointError as e:
            if layer.prefix in str(e):
                raise
            raise CorruptCheckpointError(f"{layer.prefix}: {e}") from e
        if layer.codes.is_cuda and triton_available():
            self._prepare_kernel(layer)

    def _prepare_kernel(self, layer: nn.Module) -> None:
        """Swap the unpacked layout for the Triton kernel's (kept only if the kernel can take
        it: one g_idx row whose groups sort into equal contiguous runs)."""
        from llmaccel.kernels.gemm import prepare_packed_weight

        if layer.g_idx.shape[0] != 1:
            return
        pw = prepare_packed_weight(layer.codes.data, layer.scales.data, layer.zeros.data,
                                   layer.g_idx.data[0], self.bits, torch.get_default_dtype()
                                   if layer.scales.dtype == torch.float32 else
                                   layer.scales.dtype)
        if pw is None:
            return
        for name in ("codes", "scales", "zeros", "g_idx"):
            delattr(layer, name)
        # parameters, like the checkpoint tensors they replace (weight-byte counts see them)
        for name, t in (("kernel_weight", pw.weight), ("kernel_scales", pw.scales),
                        ("kernel_zeros", pw.zeros), ("kernel_perm", pw.perm)):
            layer.register_parameter(name, None if t is None else
                                     nn.Parameter(t, requires_grad=False))
        layer.kernel_group_size = pw.group_size

    def fused_decode_config(self, layer: nn.Module, m: int, kind: str):
        """The W4A16 GEMV tile for a fused decode layer (norm / SiLU-and-mul / residual folded
        into the GEMV), or None: 4-bit kernel layout, one row, no act-order permutation (the
        prologue would have to gather): a Triton tile for this fusion in the GPU's table
        (`kernels/gemv_w4.py`). Not the CUDA C GEMV: its blocks each recompute the whole
        row's norm or SiLU, 587 against 701 tok/s unfused (W1 int4, 3B, H100). benchmarks/tune_fused_decode_quant.py writes one only where the
        fused chain measured faster than the unfused one; on an H100 it was slower (the Triton
        int4 GEMV has about four instructions per weight to spend and the prologue's per-input
        work exceeds them), so there the Triton path runs int4 layers unfused."""
        if (self.bits != 4 or m != 1 or not hasattr(layer, "kernel_weight")
                or layer.kernel_perm is not None or not kind):
            return None
        from llmaccel.kernels.gemm_tuning import fused_w4_config

        return fused_w4_config(kind, layer.output_size, layer.input_size,
                               layer.kernel_group_size, layer.kernel_weight.device)

    def apply_fused(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                    config, **fusion) -> torch.Tensor:
        from llmaccel.kernels.gemv_w4 import w4a16_gemv

        return w4a16_gemv(x, layer.kernel_weight, layer.kernel_scales, layer.kernel_zeros,
                          layer.kernel_group_size, bias, config, **fusion)

    def apply_silu_out(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                       x_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """silu_and_mul(layer(x)) for one row of a [gate; up] int4 layer in the CUDA C GEMV,
        the activation in its epilogue (one kernel fewer a layer), or None where that GEMV
        does not run. The Triton GEMV's SiLU epilogue is not used: it matched the GEMV +
        silu_and_mul pair alone on an H100 (13.2 against 14.0 us)
        but whole llama-3.2-3b decode steps ran slower with it, 14% with the dependent released
        after the wait and W1 1.6% slower with it released at the end."""
        if (x_scale is not None or not hasattr(layer, "kernel_weight")
                or layer.kernel_perm is not None or not _use_cuda_gemv(layer, x, bias)):
            return None
        from llmaccel.kernels.gemv_w4_cuda import w4a16_gemv_cuda

        return w4a16_gemv_cuda(x, layer.kernel_weight, layer.kernel_scales, layer.kernel_zeros,
                               layer.kernel_group_size, bias, silu_out=True,
                               prefetch=layer_ranges(layer))

    def apply_qkv_rope(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                       rope) -> torch.Tensor | None:
        """q [1, q_size] of one decode token of a [q; k; v] int4 layer through the CUDA C
        GEMV with rope and the K/V cache write in its epilogue (`kernels/gemv_w4_cuda.py`,
        `RopeCache`), or None where that GEMV does not run."""
        if (not hasattr(layer, "kernel_weight") or layer.kernel_perm is not None
                or not _use_cuda_gemv(layer, x, bias)):
            return None
        from llmaccel.kernels.gemv_w4_cuda import w4a16_gemv_cuda

        return w4a16_gemv_cuda(x, layer.kernel_weight, layer.kernel_scales, layer.kernel_zeros,
                               layer.kernel_group_size, bias, rope=rope,
                               prefetch=layer_ranges(layer))

    def _unpack(self, layer: nn.Module) -> None:
        """Replace the checkpoint tensors with the unpacked layout (via `_set_unpacked`)."""
        raise NotImplementedError

    def apply(self, layer, x, bias=None):
        if hasattr(layer, "kernel_weight"):
            return self._kernel_matmul(layer, x, bias)
        return self._reference_matmul(layer, x, bias)

    def _kernel_matmul(self, layer: nn.Module, x: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        from llmaccel.kernels.gemm import linear_ref, triton_linear
        from llmaccel.kernels.gemm_tuning import packed_config

        if layer.kernel_perm is not None:
            x = x.index_select(-1, layer.kernel_perm)
        args = (layer.kernel_weight, self.bits, layer.kernel_scales, layer.kernel_zeros,
                layer.kernel_group_size, bias)
        if not layer.use_triton:  # fused kernels switched off: the same layout, in PyTorch
            return linear_ref(x, *args)
        x2 = x.reshape(-1, x.shape[-1])
        if self.bits == 4 and _use_w4_wgmma(layer, x2, bias):  # prefill rows on Hopper
            from llmaccel.kernels.gemm_w4_wgmma import w4a16_gemm_wgmma

            return w4a16_gemm_wgmma(x, layer.kernel_weight, layer.kernel_scales,
                                    layer.kernel_zeros, layer.kernel_group_size, bias)
        if self.bits == 4 and _use_w4_gemm(layer, x2, bias):  # 2+ rows: tensor cores on int4
            from llmaccel.kernels.gemm_w4_cuda import w4a16_gemm_cuda

            return w4a16_gemm_cuda(x, layer.kernel_weight, layer.kernel_scales,
                                   layer.kernel_zeros, layer.kernel_group_size, bias)
        min_m = DEQUANT_GEMM_MIN_M.get(self.bits, 0)
        if (min_m and x2.shape[0] >= min_m and x.is_cuda
                and x.dtype in (torch.bfloat16, torch.float16)):
            from llmaccel.kernels.gemm import dequantize_packed

            w = dequantize_packed(layer.kernel_weight, self.bits, layer.kernel_scales,
                                  layer.kernel_zeros, layer.kernel_group_size, x.dtype)
            return F.linear(x, w, bias)
        group = x.shape[-1] if layer.kernel_group_size == -1 else layer.kernel_group_size
        if self.bits == 4 and x2.shape[0] == 1:
            if _use_cuda_gemv(layer, x, bias):  # batch-1 decode: the CUDA C GEMV
                from llmaccel.kernels.gemv_w4_cuda import w4a16_gemv_cuda

                return w4a16_gemv_cuda(x, layer.kernel_weight, layer.kernel_scales,
                                       layer.kernel_zeros, layer.kernel_group_size, bias,
                                       prefetch=layer_ranges(layer))
            gemv = _gemv_w4_config(layer, x.shape[-1], x.device)
            if gemv is not None:  # batch-1 decode: the dedicated GEMV
                from llmaccel.kernels.gemv_w4 import w4a16_gemv

                return w4a16_gemv(x, layer.kernel_weight, layer.kernel_scales,
                                  layer.kernel_zeros, layer.kernel_group_size, bias, gemv)
        cfg = packed_config(x2.shape[0], layer.output_size, x.shape[-1], self.bits, group,
                            x.device)
        return triton_linear(x, *args, config=cfg)

    @staticmethod
    def _reference_matmul(layer: nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        w = dequantize_unpacked(layer.codes, layer.scales, layer.zeros, layer.g_idx,
                                layer.output_sizes, x.dtype)
        return F.linear(x, w, bias)


class GPTQLinearMethod(PackedLinearMethod):
    """qweight int32 [in/pf, out], qzeros int32 [G, out/pf], scales [G, out], g_idx [in]."""

    format_name = "gptq"

    def __init__(self, bits: int, group_size: int, sym: bool, checkpoint_format: str) -> None:
        super().__init__(bits, group_size, sym)
        self.zero_offset = ZERO_OFFSETS[checkpoint_format]
        self.pf = pack_factor(bits)

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        out = sum(output_sizes)
        n_groups = input_size // self._group_len(input_size, layer.prefix)
        _check_divisible(layer.prefix, input_size, self.pf, "in_features")
        for size in output_sizes:
            _check_divisible(layer.prefix, size, self.pf, "each fused output")
        layer.register_parameter("qweight", _param((input_size // self.pf, out), torch.int32, 1))
        layer.register_parameter("qzeros", _param((n_groups, out // self.pf), torch.int32, 1,
                                                  self.pf))
        layer.register_parameter("scales", _param((n_groups, out), torch.float32, 1))
        g_idx = _param((len(output_sizes), input_size), torch.int32)
        g_idx.weight_loader = _per_shard_loader("g_idx")
        layer.register_parameter("g_idx", g_idx)

    def _unpack(self, layer: nn.Module) -> None:
        codes = unpack_int32(layer.qweight.data, self.bits, dim=0).t()
        zeros = (unpack_int32(layer.qzeros.data, self.bits, dim=1) + self.zero_offset).t()
        self._set_unpacked(layer, ("qweight", "qzeros", "scales", "g_idx"), codes,
                           layer.scales.data.t(), zeros, layer.g_idx.data)


class AWQLinearMethod(PackedLinearMethod):
    """qweight int32 [in, out/8], qzeros int32 [G, out/8], scales [G, out] (AWQ GEMM)."""

    format_name = "awq"

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        out = sum(output_sizes)
        n_groups = input_size // self._group_len(input_size, layer.prefix)
        for size in output_sizes:
            _check_divisible(layer.prefix, size, AWQ_PACK_FACTOR, "each fused output")
        pf = AWQ_PACK_FACTOR
        layer.register_parameter("qweight", _param((input_size, out // pf), torch.int32, 1, pf))
        layer.register_parameter("qzeros", _param((n_groups, out // pf), torch.int32, 1, pf))
        layer.register_parameter("scales", _param((n_groups, out), torch.float32, 1))

    def _unpack(self, layer: nn.Module) -> None:
        codes, scales, zeros = unpack_awq(layer.qweight.data, layer.qzeros.data,
                                          layer.scales.data)
        in_features = codes.shape[1]
        g_idx = torch.arange(in_features, device=codes.device) // (in_features // scales.shape[1])
        self._set_unpacked(layer, ("qweight", "qzeros", "scales"), codes, scales, zeros, g_idx)


class CompressedTensorsLinearMethod(PackedLinearMethod):
    """pack-quantized: weight_packed int32 [out, in/pf], weight_scale [out, G], weight_shape
    int64 [2] (one per fused shard), weight_zero_point int32 [out/pf, G] (asymmetric only)."""

    format_name = "compressed-tensors"

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        pf = 32 // self.bits
        out = sum(output_sizes)
        n_groups = input_size // self._group_len(input_size, layer.prefix)
        # compressed-tensors pads a row to whole words; fused shards must still start on one.
        if not self.sym:
            for size in output_sizes:
                _check_divisible(layer.prefix, size, pf, "each fused output (zero points)")
        layer.register_parameter("weight_packed", _param((out, -(-input_size // pf)),
                                                         torch.int32, 0))
        layer.register_parameter("weight_scale", _param((out, n_groups), torch.float32, 0))
        shape = _param((len(output_sizes), 2), torch.int64)
        shape.weight_loader = _per_shard_loader("weight_shape")
        layer.register_parameter("weight_shape", shape)
        if not self.sym:
            layer.register_parameter("weight_zero_point", _param((out // pf, n_groups),
                                                                 torch.int32, 0, pf))

    def _unpack(self, layer: nn.Module) -> None:
        expected = [[size, layer.input_size] for size in layer.output_sizes]
        if layer.weight_shape.data.tolist() != expected:
            raise CorruptCheckpointError(
                f"{layer.prefix}.weight_shape holds {layer.weight_shape.data.tolist()}, "
                f"expected {expected} (out, in) per shard")
        zp = getattr(layer, "weight_zero_point", None)
        codes, scales, zeros = unpack_compressed_tensors(
            layer.weight_packed.data, layer.weight_scale.data,
            torch.tensor([layer.output_size, layer.input_size]),
            None if zp is None else zp.data, num_bits=self.bits)
        g_idx = torch.arange(layer.input_size, device=codes.device) // (
            layer.input_size // scales.shape[1])
        packed = ("weight_packed", "weight_scale", "weight_shape") + (
            () if zp is None else ("weight_zero_point",))
        self._set_unpacked(layer, packed, codes, scales, zeros, g_idx)


def _check_divisible(prefix: str, size: int, factor: int, what: str) -> None:
    if size % factor:
        raise CorruptCheckpointError(f"{prefix}: {what} ({size}) is not a multiple of {factor}, "
                                     "which this packed format needs")
