"""NF4: bitsandbytes' 4-bit NormalFloat weights with blockwise absmax scaling (QLoRA).

The weight is flattened (row-major) and cut into blocks of `blocksize` consecutive elements
(64 by default, bitsandbytes' default; the last block may be shorter). Each block keeps its
absolute maximum `absmax` in fp32, and each element the index of the code-book value nearest to
w / absmax:

    W_hat[i] = NF4_CODE[codes[i]] * absmax[i // blocksize]      (fp32, then the weight's dtype)

Blocks run over the flattened tensor, not along rows: a block spans two rows when in_features
is not a multiple of `blocksize`, exactly as bitsandbytes does it.

The code book (QLoRA, Dettmers et al. 2023, section 3 and appendix E) holds quantiles of a
standard normal, normalized to [-1, 1]: 8 positive quantiles and 7 negative ones at evenly
spaced probabilities between 1 - delta and 1/2, plus an exact zero. delta is the mean of
1 / (2 * 15) and 1 / (2 * 16), which keeps the extreme quantiles finite (bitsandbytes rounds
1 - delta to 0.9677083). `normal_float_code` derives the values; `NF4_CODE` holds them as the
fp32 numbers bitsandbytes publishes and writes into every checkpoint's `quant_map`, which is
what readers use, so quantizing against exactly those values keeps our codes and theirs equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.errors import QuantizationError
from llmaccel.models.layers.packed_formats import (  # noqa: F401 - read side, shared
    _blocks,
    dequantize_nf4_flat,
)

# bitsandbytes' NF4 table (functional.get_4bit_type("nf4")), fp32; index = the 4-bit code.
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=torch.float32)
NF4_ZERO_CODE = 7  # the index of 0.0; also what pads an odd element count to whole bytes
# bitsandbytes' quantize_4bit accepts these (32 only on CUDA builds from 0.45 on).
NF4_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BLOCKSIZE = 64


def normal_float_code(bits: int = 4) -> torch.Tensor:
    """The NormalFloat-`bits` code book from its definition (float64, sorted, max 1.0).

    For bits=4 it agrees with `NF4_CODE` to 2e-7 (bitsandbytes truncates 1 - delta to 7
    digits and stores fp32), so the published table is what quantization uses.
    """
    levels = 2**bits
    delta = 0.5 * (1 / (2 * (levels - 1)) + 1 / (2 * levels))

    def quantiles(count: int) -> torch.Tensor:
        # `count` evenly spaced probabilities from 1 - delta down to (not including) 1/2
        probs = torch.linspace(1 - delta, 0.5, count + 1, dtype=torch.float64)[:-1]
        return torch.special.ndtri(probs)

    # one more positive value than negative ones, so that 0 is exactly representable
    positive, negative = quantiles(levels // 2), -quantiles(levels // 2 - 1)
    values = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return values / values.max()


@dataclass(frozen=True)
class NF4Weight:
    """An NF4-quantized weight in the unpacked reference layout (one code per element)."""

    codes: torch.Tensor  # uint8, the weight's shape, values 0..15 (indices into quant_map)
    absmax: torch.Tensor  # fp32 [ceil(numel / blocksize)]
    blocksize: int
    quant_map: torch.Tensor = field(default_factory=lambda: NF4_CODE.clone())  # fp32 [16]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def n_blocks(self) -> int:
        return self.absmax.numel()


def check_blocksize(blocksize: int) -> int:
    if blocksize not in NF4_BLOCKSIZES:
        raise QuantizationError(f"NF4 blocksize must be one of {NF4_BLOCKSIZES} (bitsandbytes' "
                                f"sizes), got {blocksize}")
    return blocksize


def quantize_nf4(weight: torch.Tensor, blocksize: int = DEFAULT_BLOCKSIZE) -> NF4Weight:
    """NF4 codes and per-block absmax of `weight` (any shape), as bitsandbytes' quantize_4bit
    computes them: nearest code-book entry of w * (1 / absmax), ties to the lower entry."""
    check_blocksize(blocksize)
    if not weight.is_floating_point():
        raise QuantizationError(f"expected a floating-point weight, got {weight.dtype}")
    if not torch.isfinite(weight).all():
        raise QuantizationError("weight has inf or NaN values")
    flat = weight.detach().reshape(-1).to(torch.float32)
    blocks = _blocks(flat, blocksize)  # zero padding never raises a block's absmax
    absmax = blocks.abs().amax(dim=1)
    # An all-zero block keeps absmax 0 (it dequantizes to zeros); only its divisor is guarded.
    # Multiplying by the reciprocal, as bitsandbytes' kernels do, keeps codes equal to theirs.
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1)
    code = NF4_CODE.to(flat.device)
    midpoints = (code[:-1] + code[1:]) / 2  # nearest entry = number of midpoints below it
    codes = torch.bucketize(scaled.reshape(-1)[:flat.numel()], midpoints)
    return NF4Weight(codes=codes.to(torch.uint8).reshape(weight.shape), absmax=absmax,
                     blocksize=blocksize, quant_map=code.clone())


def dequantize_nf4(qw: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W_hat in the weight's shape: computed in fp32, then cast to `dtype`."""
    flat = dequantize_nf4_flat(qw.codes, qw.absmax, qw.quant_map, qw.blocksize)
    return flat.reshape(qw.shape).to(dtype)


@dataclass(frozen=True)
class NF4LinearQuant:
    """What `quantize_linears_nf4` hands the checkpoint writer for one Linear."""

    qweight: NF4Weight
    g_idx: None = None  # the interface of layerwise.LinearQuant; NF4 has no act-order

    def dequantize(self) -> torch.Tensor:
        return dequantize_nf4(self.qweight)


@torch.no_grad()
def quantize_linears_nf4(layer: nn.Module, names: tuple[str, ...],
                         blocksize: int = DEFAULT_BLOCKSIZE) -> dict[str, NF4LinearQuant]:
    """NF4 on the named linears of an HF decoder layer, in place: each weight becomes its
    dequantized NF4 value, so the layer's forward is what a reader of the checkpoint computes.
    Each weight is blocked on its own, as bitsandbytes quantizes q, k and v separately."""
    out: dict[str, NF4LinearQuant] = {}
    for name in names:
        lin = layer.get_submodule(name)
        qw = quantize_nf4(lin.weight.data, blocksize)
        lin.weight.data.copy_(dequantize_nf4(qw, lin.weight.dtype))
        out[name] = NF4LinearQuant(qw)
    return out


def check_nf4_settings(fmt: str | None, bits: int | None, sym: bool | None,
                       blocksize: int) -> str:
    """The checkpoint format for `quantize --method nf4`; refuses flags that contradict it."""
    if bits is not None and bits != 4:
        raise QuantizationError(f"nf4 stores 4-bit codes: leave --bits out or pass 4, got {bits}")
    if sym is False:
        raise QuantizationError("nf4 scales each block by its absmax (no zero points): --asym "
                                "does not apply")
    if fmt not in (None, "bitsandbytes"):
        raise QuantizationError(f"nf4 checkpoints are written in the bitsandbytes format, got "
                                f"format {fmt!r}")
    check_blocksize(blocksize)
    return "bitsandbytes"


__all__ = ["DEFAULT_BLOCKSIZE", "NF4_BLOCKSIZES", "NF4_CODE", "NF4LinearQuant", "NF4Weight",
           "check_blocksize", "check_nf4_settings", "dequantize_nf4", "dequantize_nf4_flat",
           "normal_float_code", "quantize_linears_nf4", "quantize_nf4"]
