"""GPTQ (Frantar et al. 2022): quantize a Linear weight column by column, pushing each column's
rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the
layer's reconstruction loss ||X W^T - X W_hat^T||^2.

The Hessian of that loss with respect to one row of W is H = 2 X^T X (X: calibration
activations [tokens, in_features]); every row shares it, which is what makes GPTQ cheap: one
Cholesky factorization per layer, then one pass over the columns for all rows at once.

Grid and layout are RTN's (`llmaccel.quant.rtn`): the same `compute_scales_zeros`, the same
unsigned codes, so with no correlation to exploit (H = identity) GPTQ returns RTN's codes
bit for bit, and the result packs with `pack_gptq` unchanged.

Act-order (`desc_act` in checkpoints) processes columns by decreasing diag(H), so the channels
with the largest activations are quantized first, while the most columns are left to absorb
their error. Groups are then formed along that processing order, so input channel i belongs to
group g_idx[i] = (position of i in the order) // group_size, not i // group_size; that is the
map GPTQ checkpoints store as `g_idx`, and `dequantize_with_g_idx` computes the weights from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.errors import QuantizationError
from llmaccel.quant.formats.gptq import pack_gptq
from llmaccel.quant.rtn import (
    SUPPORTED_BITS,
    QuantizedWeight,
    check_group_size,
    compute_scales_zeros,
    dequantize,
    round_to_codes,
)


class HessianAccumulator:
    """Running H = 2/n * sum over tokens of x x^T for one Linear's inputs, in fp32.

    Batches stream in through `add`; H is kept as an average (not a sum) so its magnitude does
    not grow with the number of calibration tokens, which keeps fp32 accurate and makes
    `damp_percent` (relative to mean(diag H)) mean the same for any amount of data.
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None) -> None:
        if in_features <= 0:
            raise QuantizationError(f"in_features must be positive, got {in_features}")
        self.in_features = in_features
        self.n_tokens = 0
        self._h = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)

    def add(self, x: torch.Tensor, first_row_weight: float = 1.0) -> None:
        """Fold in activations [..., in_features] (every leading axis counts as tokens).

        `first_row_weight` counts the first row as that many tokens (scaling it by its square
        root): `quantize_layer_gptq` passes one sequence per call and weights its first token,
        the attention sink (see `sink_weight`)."""
        if x.shape[-1] != self.in_features:
            raise QuantizationError(f"activations have {x.shape[-1]} features, expected "
                                    f"{self.in_features}")
        if first_row_weight < 1:
            raise QuantizationError(f"first_row_weight must be >= 1, got {first_row_weight}")
        x = x.reshape(-1, self.in_features).to(device=self._h.device, dtype=torch.float32)
        m = x.shape[0]
        if m == 0:
            return
        if not torch.isfinite(x).all():
            raise QuantizationError("calibration activations have inf or NaN values")
        if first_row_weight != 1:
            x = x.clone()
            x[0] *= first_row_weight ** 0.5
            m = m - 1 + first_row_weight
        total = self.n_tokens + m
        # Rescale the old average to the new count, then add the new batch already divided by
        # it: H_new = (n/total) H_old + (2/total) X^T X, never forming the raw sum.
        self._h.mul_(self.n_tokens / total)
        x = x * (2.0 / total) ** 0.5
        self._h.addmm_(x.t(), x)
        self.n_tokens = total

    @property
    def hessian(self) -> torch.Tensor:
        if self.n_tokens == 0:
            raise QuantizationError("no calibration activations were added to the Hessian")
        return self._h


def sink_weight(seq_len: int, weight: float | None = None) -> float:
    """How many tokens the first token of each calibration sequence counts as in the Hessian.

    The first token of a sequence becomes the attention sink: it carries massive activations
    and every later token attends to it (Xiao et al. 2023, StreamingLLM; Sun et al. 2024,
    "Massive Activations"). The plain Hessian weighs it as 1 token in seq_len, so GPTQ trades
    its error for the average token's, and that costs perplexity: on SmolLM2-135M (int4 g64,
    8 x 512 calibration tokens, 3 WikiText-2 windows) dropping the sink rows more than tripled
    GPTQ's perplexity increase over bf16, and counting each as 8 tokens cut it from 9.5 to 6.5
    (RTN: 11.7); 32 gave the same as 8. None (the default) scales with the sequence, so the
    sinks keep the same share of the Hessian for any seq_len: seq_len / 64, at least 1."""
    if weight is None:
        return max(1.0, seq_len / 64)
    if weight < 1:
        raise QuantizationError(f"sink weight must be >= 1, got {weight}")
    return float(weight)


@dataclass(frozen=True)
class GPTQResult:
    """`gptq_quantize`'s output: the weight plus the group map GPTQ checkpoints store.

    Without act-order, g_idx[i] = i // group_len and `qweight` decodes with `rtn.dequantize`.
    With act-order, codes are in the original column order but column i's scale and zero are
    at group g_idx[i]; decode with `dequantize_with_g_idx` (rtn.dequantize would be wrong).
    """

    qweight: QuantizedWeight
    g_idx: torch.Tensor  # int32 [in_features]
    perm: torch.Tensor | None  # int64 [in_features], processing order; None without act-order

    @property
    def act_order(self) -> bool:
        return self.perm is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.perm is None:
            return dequantize(self.qweight, dtype)
        return dequantize_with_g_idx(self.qweight, self.g_idx, dtype)

    def pack(self, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
        """GPTQ checkpoint tensors. `pack_gptq` writes the contiguous g_idx; qweight, qzeros
        and scales do not depend on it, so only g_idx is swapped for the act-order map."""
        tensors = pack_gptq(self.qweight, checkpoint_format)
        tensors["g_idx"] = self.g_idx.to(device=tensors["g_idx"].device, dtype=torch.int32)
        return tensors


def dequantize_with_g_idx(qw: QuantizedWeight, g_idx: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W_hat[o, i] = (codes[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]], in fp32."""
    if tuple(g_idx.shape) != (qw.in_features,):
        raise QuantizationError(f"g_idx has shape {tuple(g_idx.shape)}, expected "
                                f"({qw.in_features},)")
    g = g_idx.to(device=qw.codes.device, dtype=torch.int64)
    if g.numel() and (g.min() < 0 or g.max() >= qw.n_groups):
        raise QuantizationError(f"g_idx values must lie in 0..{qw.n_groups - 1}")
    zeros = qw.zeros[:, g].to(torch.int32)
    scales = qw.scales[:, g].to(torch.float32)
    return ((qw.codes.to(torch.int32) - zeros).to(torch.float32) * scales).to(dtype)


def _block_len(block_size: int, group_len: int, in_features: int, per_channel: bool) -> int:
    """Block length such that no group starts inside a block and ends outside it.

    Columns past the current block receive the block's error only when the block ends (the lazy
    batch update), so a group straddling the boundary would get its scale from partly stale
    weights. Groups that start at a block start are fine: at that moment everything before them
    has been flushed.
    """
    if per_channel:
        return min(block_size, in_features)
    if block_size >= group_len:
        return (block_size // group_len) * group_len  # whole groups per block
    # Groups longer than blocks: a block length dividing group_len puts every group start on
    # a block start.
    return max(d for d in range(1, block_size + 1) if group_len % d == 0)


def _inverse_hessian_factor(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U).

    Row j of U, divided by U[j, j], is the update that spreads column j's error over the later
    columns with all earlier columns already fixed: the paper's sequential elimination of rows
    and columns from H^-1, computed once instead of per column.
    """
    try:
        lower = torch.linalg.cholesky(h)
        h_inv = torch.cholesky_inverse(lower)
        return torch.linalg.cholesky(h_inv, upper=True)
    except torch.linalg.LinAlgError as exc:
        raise QuantizationError("the calibration Hessian is not positive definite after "
                                "dampening; raise damp_percent or add calibration data") from exc


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int = 4,
                  group_size: int = 128, sym: bool = True, damp_percent: float = 0.01,
                  block_size: int = 128, act_order: bool = False,
                  scale_dtype: torch.dtype = torch.float16) -> GPTQResult:
    """GPTQ-quantize a Linear weight [out_features, in_features] given its input Hessian
    [in_features, in_features] (from `HessianAccumulator`).

    Input channels never activated (diag(H) = 0) cannot affect the output: their weights are
    set to 0 and H_ii to 1, so H stays invertible and they quantize exactly. `damp_percent` *
    mean(diag H) is added to the diagonal against ill-conditioning from few or correlated
    tokens. Runs on the weight's device in fp32.
    """
    if bits not in SUPPORTED_BITS:
        raise QuantizationError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise QuantizationError(f"expected a 2-D floating-point weight, got {weight.dim()}-D "
                                f"{weight.dtype}")
    out_features, in_features = weight.shape
    if tuple(hessian.shape) != (in_features, in_features):
        raise QuantizationError(f"Hessian has shape {tuple(hessian.shape)}, expected "
                                f"({in_features}, {in_features}) for weight {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise QuantizationError("weight has inf or NaN values")
    if not torch.isfinite(hessian).all():
        raise QuantizationError("Hessian has inf or NaN values")
    if damp_percent < 0:
        raise QuantizationError(f"damp_percent must be >= 0, got {damp_percent}")
    if block_size <= 0:
        raise QuantizationError(f"block_size must be positive, got {block_size}")
    group_len = check_group_size(in_features, group_size)
    per_channel = group_size == -1

    device = weight.device
    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(device=device, dtype=torch.float32).clone()

    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm: torch.Tensor | None = None
    if act_order:
        # stable: equal diagonals keep their order, so H = c * I leaves the columns in place
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w = w[:, perm]
        h = h[perm][:, perm]

    diag = torch.arange(in_features, device=device)
    h[diag, diag] += damp_percent * torch.mean(torch.diagonal(h))
    u = _inverse_hessian_factor(h)
    del h

    n_groups = in_features // group_len
    scales = torch.empty(out_features, n_groups, dtype=scale_dtype, device=device)
    zeros = torch.empty(out_features, n_groups, dtype=torch.int32, device=device)
    codes = torch.empty(out_features, in_features, dtype=torch.uint8, device=device)
    if per_channel:
        # One grid per row from the whole (dead-zeroed) row, as RTN: error feedback cannot move
        # it afterwards, so a column pushed past the row's range simply clamps.
        s, z = compute_scales_zeros(w, bits, sym, scale_dtype)
        scales[:, 0], zeros[:, 0] = s, z
    scale_f = zero_f = None
    if per_channel:
        scale_f, zero_f = scales[:, 0].to(torch.float32), zeros[:, 0].to(torch.float32)

    blk = _block_len(block_size, group_len, in_features, per_channel)
    for i1 in range(0, in_features, blk):
        i2 = min(i1 + blk, in_features)
        w1 = w[:, i1:i2].clone()  # this block's columns, error-updated column by column
        u1 = u[i1:i2, i1:i2]
        err1 = torch.empty_like(w1)
        for i in range(i2 - i1):
            col = i1 + i
            if not per_channel and col % group_len == 0:
                # The group's grid comes from its weights as they are now, with every earlier
                # column's error already folded in (the block layout guarantees that).
                if i + group_len <= i2 - i1:
                    group = w1[:, i:i + group_len]
                else:  # the group starts this block and runs past it: i == 0, all flushed
                    group = w[:, col:col + group_len]
                s, z = compute_scales_zeros(group, bits, sym, scale_dtype)
                scales[:, col // group_len], zeros[:, col // group_len] = s, z
                scale_f, zero_f = s.to(torch.float32), z.to(torch.float32)
            assert scale_f is not None and zero_f is not None
            wc = w1[:, i]
            q = round_to_codes(wc, scale_f, zero_f, bits)
            codes[:, col] = q
            w_hat = (q.to(torch.float32) - zero_f) * scale_f
            # Error scaled by 1 / [H^-1]_cc (via the factor's diagonal), then spread over the
            # block's later columns by the factor's row: the optimal compensation for them.
            e = (wc - w_hat) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = e
        # Lazy batch update: the block's errors reach the remaining columns as one matmul, so
        # the work is GEMM-bound instead of one rank-1 update per column over the whole row.
        w[:, i2:] -= err1 @ u[i1:i2, i2:]

    if perm is not None:
        g_perm = torch.arange(in_features, device=device) // group_len
        g_idx = torch.empty(in_features, dtype=torch.int32, device=device)
        g_idx[perm] = g_perm.to(torch.int32)  # original column perm[j] was j-th in line
        orig = torch.empty_like(codes)
        orig[:, perm] = codes
        codes = orig
    else:
        g_idx = (torch.arange(in_features, device=device) // group_len).to(torch.int32)

    qw = QuantizedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits,
                         group_size=group_size, sym=sym)
    return GPTQResult(qweight=qw, g_idx=g_idx, perm=perm)
