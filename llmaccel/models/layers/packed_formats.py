"""The read side of the quantized checkpoint formats the engine loads: how GPTQ, AWQ,
compressed-tensors and bitsandbytes NF4 pack their codes, and how to unpack them. The linear
methods (models/layers/linear_methods.py, bnb_linear.py) read checkpoints through these; the
writers in quant/formats/ pack with the same definitions."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from llmaccel.errors import CorruptCheckpointError, QuantizationError

SUPPORTED_BITS = (4, 8)
# checkpoint_format -> what is subtracted from each zero point before it is packed.
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}


def pack_factor(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise QuantizationError(f"GPTQ packing supports bits in {SUPPORTED_BITS}, got {bits}")
    return 32 // bits


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `bits`-wide values along `dim`, 32 // bits per int32, the first value of
    each run in the lowest bits."""
    pf = pack_factor(bits)
    v = values.to(torch.int64).movedim(dim, -1)  # int64 first: uint8 cannot compare with 256
    if v.numel() and (v.min() < 0 or v.max() >= 2**bits):
        raise QuantizationError(f"values must lie in 0..{2**bits - 1} to pack as {bits}-bit fields")
    n = v.shape[-1]
    if n % pf:
        raise QuantizationError(f"cannot pack {n} values into int32 words of {pf}")
    v = v.reshape(*v.shape[:-1], n // pf, pf)
    shifts = torch.arange(pf, dtype=torch.int64, device=v.device) * bits
    words = (v << shifts).sum(dim=-1)  # the fields are disjoint, so the sum is a bitwise OR
    words = torch.where(words >= 2**31, words - 2**32, words)  # same 32 bits, read as signed
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words -> int32 values in 0 .. 2**bits - 1."""
    pf = pack_factor(bits)
    words = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(pf, dtype=torch.int64, device=words.device) * bits
    fields = (words.unsqueeze(-1) >> shifts) & (2**bits - 1)
    values = fields.reshape(*words.shape[:-1], words.shape[-1] * pf)
    return values.to(torch.int32).movedim(-1, dim).contiguous()


AWQ_BITS = 4
AWQ_PACK_FACTOR = 32 // AWQ_BITS
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i <- output feature AWQ_PACK_ORDER[i]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output feature j <- nibble AWQ_UNPACK_ORDER[j]
_NIBBLE_MAX = (1 << AWQ_BITS) - 1


def unpack_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read one AWQ GEMM layer back as (codes uint8 [out, in], scales [out, n_groups],
    zeros uint8 [out, n_groups]); scales keep their stored dtype.

    `group_size` is implied by the shapes; pass it to have the checkpoint's config checked too.
    """
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise CorruptCheckpointError(
                f"AWQ {name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}"
            )
    in_features, out_features = qweight.shape[0], qweight.shape[1] * AWQ_PACK_FACTOR
    n_groups = qzeros.shape[0]
    if (
        scales.dim() != 2
        or tuple(scales.shape) != (n_groups, out_features)
        or qzeros.shape[1] != qweight.shape[1]
        or n_groups == 0
        or in_features % n_groups != 0
    ):
        raise CorruptCheckpointError(
            f"AWQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    if group_size is not None and in_features // n_groups != group_size:
        raise CorruptCheckpointError(
            f"AWQ tensors hold groups of {in_features // n_groups} input features, "
            f"but the config says group_size={group_size}"
        )
    codes = _unpack_rows(qweight).t().contiguous()
    zeros = _unpack_rows(qzeros).t().contiguous()
    return codes, scales.t().contiguous(), zeros


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, n] -> uint8 [rows, n * 8] nibbles, undoing AWQ's interleave."""
    shifts = torch.arange(0, 32, AWQ_BITS, device=words.device, dtype=torch.int32)
    # Arithmetic shift of a negative word drags sign bits in from the top; the mask drops them.
    nibbles = (words.unsqueeze(-1) >> shifts) & _NIBBLE_MAX
    nibbles = nibbles[..., list(AWQ_UNPACK_ORDER)]
    return nibbles.reshape(words.shape[0], -1).to(torch.uint8)


CT_BITS = (4, 8)


def unpack_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int],
    weight_zero_point: torch.Tensor | None = None,
    *,
    num_bits: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read one pack-quantized layer back as (codes uint8 [out, in], scales [out, n_groups],
    zeros uint8 [out, n_groups]). Without a zero point (symmetric) zeros are 2^(bits-1).

    Accepts any group size the shapes imply, so third-party checkpoints read too.
    """
    if num_bits not in CT_BITS:
        raise QuantizationError(f"pack-quantized supports num_bits {CT_BITS}, got {num_bits}")
    dims = [int(v) for v in weight_shape]
    if len(dims) != 2:
        raise CorruptCheckpointError(f"weight_shape must hold (out, in), got {dims}")
    out_features, in_features = dims
    per_word = 32 // num_bits
    words_per_row = -(-in_features // per_word)
    _check_int32(weight_packed, "weight_packed", (out_features, words_per_row))
    if weight_scale.dim() != 2 or weight_scale.shape[0] != out_features:
        raise CorruptCheckpointError(
            f"weight_scale must be [out={out_features}, n_groups], got {tuple(weight_scale.shape)}"
        )
    n_groups = weight_scale.shape[1]
    if n_groups == 0 or in_features % n_groups != 0:
        raise CorruptCheckpointError(
            f"weight_scale has {n_groups} groups, which do not divide in_features={in_features}"
        )
    codes = _unpack_cols(weight_packed, num_bits, in_features)
    if weight_zero_point is None:
        zeros = torch.full(
            (out_features, n_groups), 1 << (num_bits - 1), dtype=torch.uint8,
            device=weight_packed.device,
        )
    else:
        zp_rows = -(-out_features // per_word)
        _check_int32(weight_zero_point, "weight_zero_point", (zp_rows, n_groups))
        zeros = _unpack_cols(weight_zero_point.t(), num_bits, out_features).t().contiguous()
    return codes, weight_scale, zeros


def _check_int32(t: torch.Tensor, name: str, shape: tuple[int, int]) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != shape:
        raise CorruptCheckpointError(
            f"{name} must be int32 {shape}, got {t.dtype} {tuple(t.shape)}"
        )


def _unpack_cols(words: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """int32 [rows, n] -> uint8 [rows, cols], dropping the padding past `cols`."""
    shifts = torch.arange(0, 32, num_bits, device=words.device, dtype=torch.int32)
    # The mask drops the sign bits an arithmetic shift of a negative word brings in.
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return fields.reshape(words.shape[0], -1)[:, :cols].to(torch.uint8).contiguous()


# Suffixes after "<prefix>.weight" of the tensors bitsandbytes writes for a 4-bit weight.
ABSMAX, QUANT_MAP = ".absmax", ".quant_map"
QUANT_STATE_PREFIX = ".quant_state.bitsandbytes__"
QUANT_STATE = QUANT_STATE_PREFIX + "nf4"
NESTED = (".nested_absmax", ".nested_quant_map")
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 bytes (any shape) -> uint8 [n] codes, dropping the padding code."""
    flat = packed.reshape(-1)
    if flat.dtype != torch.uint8:
        raise CorruptCheckpointError(f"bitsandbytes 4-bit weight must be uint8, got {flat.dtype}")
    if flat.numel() != -(-n // 2):
        raise CorruptCheckpointError(f"bitsandbytes 4-bit weight has {flat.numel()} bytes, "
                                     f"expected {-(-n // 2)} for {n} elements")
    return torch.stack([flat >> 4, flat & 0xF], dim=1).reshape(-1)[:n].contiguous()


def parse_quant_state(t: torch.Tensor) -> dict[str, Any]:
    try:
        state = json.loads(bytes(t.reshape(-1).to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"bitsandbytes quant_state is not UTF-8 JSON: {e}") from e
    if not isinstance(state, dict):
        raise CorruptCheckpointError("bitsandbytes quant_state must hold a JSON object")
    return state


def check_nf4_state(state: Mapping[str, Any], where: str = "quant_state"
                    ) -> tuple[int, list[int], torch.dtype]:
    """(blocksize, shape, dtype) of a parsed NF4 quant state; refuses what we do not read."""
    nested = sorted(k for k in state if k.startswith("nested"))
    if nested:
        raise QuantizationError(f"{where}.{nested[0]}: double-quantized bitsandbytes checkpoints "
                                "(bnb_4bit_use_double_quant) are not supported")
    if state.get("quant_type") != "nf4":
        raise QuantizationError(f"{where}.quant_type={state.get('quant_type')!r} is not "
                                "supported (supported: 'nf4')")
    blocksize, shape = state.get("blocksize"), state.get("shape")
    if not isinstance(blocksize, int) or blocksize <= 0:
        raise CorruptCheckpointError(f"{where}.blocksize={blocksize!r} is not a positive integer")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CorruptCheckpointError(f"{where}.shape={shape!r} is not a list of sizes")
    dtype = DTYPES.get(str(state.get("dtype", "float32")).removeprefix("torch."))
    if dtype is None:
        raise CorruptCheckpointError(f"{where}.dtype={state.get('dtype')!r} is not a float dtype")
    return blocksize, shape, dtype


def _blocks(flat: torch.Tensor, blocksize: int, pad_value: float = 0.0) -> torch.Tensor:
    """[n] -> [ceil(n / blocksize), blocksize], the short last block padded with `pad_value`."""
    return F.pad(flat, (0, -flat.numel() % blocksize), value=pad_value).view(-1, blocksize)


def dequantize_nf4_flat(codes: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor,
                        blocksize: int) -> torch.Tensor:
    """fp32 [n] from codes [n]: quant_map[code] * absmax of its block (bitsandbytes' math)."""
    values = quant_map.to(torch.float32)[codes.reshape(-1).long()]
    n = values.numel()
    if absmax.numel() != -(-n // blocksize):
        raise QuantizationError(f"{absmax.numel()} absmax values do not cover {n} elements in "
                                f"blocks of {blocksize}")
    return (_blocks(values, blocksize) * absmax.to(torch.float32).unsqueeze(1)).reshape(-1)[:n]
