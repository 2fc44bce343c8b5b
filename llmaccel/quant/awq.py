"""AWQ: activation-aware weight quantization (Lin et al. 2023), written from the paper.

The idea: a few input channels carry much larger activations than the rest, and the weights
they multiply matter most for the output. Scaling those weight columns up by s (and the
activations down by 1/s) before group quantization gives them a finer relative grid, since the
group's scale is set by its absmax and barely moves when only a few columns grow. The
transformation

    y = x W^T = (x / s) (W * s)^T

is exact in floating point, and 1/s is folded into whatever produces x (the preceding RMSNorm's
weight, or the output rows of the preceding linear), so the deployed model quantizes W * s and
carries no extra op. The paper picks s = mean|x|^alpha per input channel and grid-searches alpha
in [0, 1) against the layer's output error with the real group quantizer in the loop. alpha = 0
gives s = 1 (plain RTN), so the searched result is never worse than RTN on the calibration data.

An optional second step clips each group's max value (searched per (row, group)) to trade a
little clipping error on outliers for a finer grid on everything else.

Conventions follow `llmaccel.quant.rtn`: W is [out_features, in_features] and groups run along
in_features. `x` is the calibration input of the layer, [tokens, in_features].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmaccel.errors import QuantizationError
from llmaccel.quant.rtn import QuantizedWeight, check_group_size, dequantize, quantize_rtn

# Channels that never fire get a mean |x| of 0, and 0 ** alpha = 0 would make s = 0 and W * s
# lose the column. Floor the statistic relative to the largest channel so the floor does not
# depend on the activations' overall magnitude.
_MEAN_FLOOR = 1e-6


class ActivationStats:
    """Streaming mean |x| per input channel, fed one calibration batch at a time.

    Sums are kept in float64 so that many batches of fp16/bf16 activations do not lose the small
    channels to rounding in the running total.
    """

    def __init__(self, in_features: int) -> None:
        if in_features <= 0:
            raise QuantizationError(f"in_features must be positive, got {in_features}")
        self.in_features = in_features
        self._abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.n_tokens = 0

    def update(self, x: torch.Tensor) -> None:
        """Add a batch of activations [..., in_features] (any leading shape is flattened)."""
        if x.shape[-1] != self.in_features:
            raise QuantizationError(f"activations have {x.shape[-1]} channels, "
                                    f"expected {self.in_features}")
        flat = x.detach().reshape(-1, self.in_features)
        if not torch.isfinite(flat).all():
            raise QuantizationError("activations have inf or NaN values")
        self._abs_sum += flat.abs().to(torch.float64).sum(dim=0).cpu()
        self.n_tokens += flat.shape[0]

    def mean_abs(self) -> torch.Tensor:
        """Mean |x| per input channel, float32 [in_features]."""
        if self.n_tokens == 0:
            raise QuantizationError("no activations were recorded; run calibration data first")
        return (self._abs_sum / self.n_tokens).to(torch.float32)


def activation_scale_stats(x: torch.Tensor) -> torch.Tensor:
    """Mean |x| per input channel of activations [..., in_features] (one-shot ActivationStats)."""
    stats = ActivationStats(x.shape[-1])
    stats.update(x)
    return stats.mean_abs()


def scales_for_alpha(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x| ** alpha, normalized by sqrt(max(s) * min(s)) (as the paper's reference code).

    The normalization centres s geometrically around 1, so W * s stays in the range fp16 scales
    and the folded norm weights can hold; it changes nothing about which channels are favoured.
    """
    mean_abs = mean_abs.to(torch.float32)
    top = mean_abs.max()
    if alpha == 0 or top <= 0:
        return torch.ones_like(mean_abs)  # exact 1s: alpha = 0 must reproduce plain RTN
    s = mean_abs.clamp(min=float(top) * _MEAN_FLOOR).pow(alpha)
    return s / torch.sqrt(s.max() * s.min())


def apply_clip(weight: torch.Tensor, clip: torch.Tensor, group_size: int) -> torch.Tensor:
    """Clamp each (row, group) of `weight` to +-clip[row, group] * absmax(row, group).

    `clip` [out, n_groups] holds ratios in (0, 1]; 1 leaves the group unchanged. Symmetric about
    zero for sym and asym alike: rtn then derives its scale (and zero) from the clamped range.
    """
    out_features, in_features = weight.shape
    group_len = check_group_size(in_features, group_size)
    n_groups = in_features // group_len
    if tuple(clip.shape) != (out_features, n_groups):
        raise QuantizationError(f"clip must have shape {(out_features, n_groups)}, "
                                f"got {tuple(clip.shape)}")
    groups = weight.reshape(out_features, n_groups, group_len)
    limit = (groups.abs().amax(dim=-1) * clip.to(weight.dtype)).unsqueeze(-1)
    return torch.maximum(torch.minimum(groups, limit), -limit).reshape(out_features, in_features)


def quantize_scaled(weight: torch.Tensor, scales: torch.Tensor, bits: int = 4,
                    group_size: int = 128, sym: bool = False,
                    clip: torch.Tensor | None = None,
                    scale_dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """Quantize W * s (optionally clipped per group): the tensor an AWQ checkpoint stores.

    The layer's effective weight is dequantize(result) / s; s itself lives on in the folded
    preceding RMSNorm or linear (see `fold_scales_into_norm` / `fold_scales_into_linear`).
    """
    _check_weight(weight, scales)
    scaled = weight.to(torch.float32) * scales.to(torch.float32)
    if clip is not None:
        scaled = apply_clip(scaled, clip, group_size)
    return quantize_rtn(scaled, bits=bits, group_size=group_size, sym=sym,
                        scale_dtype=scale_dtype)


def effective_weight(qw: QuantizedWeight, scales: torch.Tensor) -> torch.Tensor:
    """W_hat = dequantize(Q(W * s)) / s: what the quantized layer computes with, as seen from x."""
    return dequantize(qw, torch.float32) / scales.to(torch.float32)


def output_error(x: torch.Tensor, weight: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||x W^T - x W_hat^T||^2 / tokens, computed as ||x (W - W_hat)^T||^2 so the large common
    part of the two outputs does not cancel away the digits that tell candidates apart."""
    diff = weight.to(torch.float32) - w_hat.to(torch.float32)
    err = x.to(torch.float32) @ diff.t()
    return float(err.double().pow(2).sum()) / max(x.shape[0], 1)


@dataclass
class ScaleSearchInfo:
    """What `search_scales` tried and found."""

    best_alpha: float
    loss_scale1: float  # output MSE of plain RTN (s = 1), summed over the weights
    loss_best: float  # output MSE with the chosen scales; never above loss_scale1
    losses: dict[float, float] = field(default_factory=dict)  # alpha -> loss

    @property
    def ratio(self) -> float:
        """loss_best / loss_scale1 (1.0 when RTN was already exact)."""
        return self.loss_best / self.loss_scale1 if self.loss_scale1 > 0 else 1.0


def search_scales(weights: list[torch.Tensor], x: torch.Tensor, bits: int = 4,
                  group_size: int = 128, sym: bool = False, n_grid: int = 20,
                  mean_abs: torch.Tensor | None = None,
                  scale_dtype: torch.dtype = torch.float16
                  ) -> tuple[torch.Tensor, ScaleSearchInfo]:
    """Grid-search alpha in {0, 1/n_grid, ..., (n_grid-1)/n_grid} for s = mean|x| ** alpha.

    `weights` are the linears that read the same input x (q/k/v, or gate/up): they must share one
    s because one folded norm/linear feeds them all, so their output errors are summed. The
    group quantizer (rtn with the checkpoint's scale dtype) runs inside the loop, so the loss is
    that of the weights actually shipped. `mean_abs` may come from a streamed `ActivationStats`
    over more data than `x`; by default it is computed from `x`.

    Guarantee: alpha = 0 (s = 1 exactly, i.e. plain RTN) is evaluated and only a strictly lower
    loss replaces it, so info.loss_best <= info.loss_scale1 on `x`.
    """
    if not weights:
        raise QuantizationError("search_scales needs at least one weight")
    if n_grid < 1:
        raise QuantizationError(f"n_grid must be at least 1, got {n_grid}")
    in_features = x.shape[-1]
    x = x.reshape(-1, in_features)
    for w in weights:
        if w.dim() != 2 or w.shape[1] != in_features:
            raise QuantizationError(f"every weight must be [out, {in_features}] to share the "
                                    f"input x, got {tuple(w.shape)}")
    if mean_abs is None:
        mean_abs = activation_scale_stats(x)
    elif tuple(mean_abs.shape) != (in_features,):
        raise QuantizationError(f"mean_abs must have shape ({in_features},), "
                                f"got {tuple(mean_abs.shape)}")

    losses: dict[float, float] = {}
    best_alpha, best_loss, best_s = 0.0, float("inf"), torch.ones(in_features, device=x.device)
    for i in range(n_grid):
        alpha = i / n_grid
        s = scales_for_alpha(mean_abs, alpha)
        loss = 0.0
        for w in weights:
            qw = quantize_scaled(w, s, bits, group_size, sym, scale_dtype=scale_dtype)
            loss += output_error(x, w, effective_weight(qw, s))
        losses[alpha] = loss
        if loss < best_loss:  # strict: ties keep the smaller alpha, s = 1 first of all
            best_alpha, best_loss, best_s = alpha, loss, s
    info = ScaleSearchInfo(best_alpha=best_alpha, loss_scale1=losses[0.0], loss_best=best_loss,
                           losses=losses)
    return best_s, info


CLIP_TOKENS = 512           # calibration rows the clip search scores (AutoAWQ samples 512 too)
CLIP_CHUNK_ELEMENTS = 1 << 24  # out rows x in channels per step: bounds the fp64 copies


def search_clip(weight: torch.Tensor, x: torch.Tensor, bits: int = 4, group_size: int = 128,
                sym: bool = False, n_grid: int = 20, max_shrink: float = 0.5,
                scale_dtype: torch.dtype = torch.float16,
                max_tokens: int = CLIP_TOKENS) -> torch.Tensor:
    """Per-(row, group) clip ratios [out, n_groups] in (1 - max_shrink, 1] for `quantize_scaled`.

    Call it on the weight the checkpoint will hold, i.e. W * s with x / s as input, so the clip
    sees the scaled ranges. Each group picks the ratio (from 1, 1 - 1/n_grid, ...) minimizing its
    own contribution ||x_g (W_g - Q(W_g))^T||^2; ratio 1 is a candidate, so no group's own term
    grows. A row's output error also has cross terms between groups, which per-group choices can
    make worse; each row whose total error rose is reset to ratio 1, so the layer's output error
    on `x` never exceeds the unclipped one.

    The errors are scored on at most `max_tokens` rows of `x`, evenly spaced (the guarantee
    above is on those rows), in fp64 through each group's Gram matrix X_g^T X_g, so a candidate
    ratio costs out x in x group_len whatever the number of tokens. Output rows go through in
    chunks so the fp64 copies stay bounded for wide layers.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise QuantizationError(f"weight {tuple(weight.shape)} does not take inputs with "
                                f"{x.shape[-1]} channels")
    if not 0 <= max_shrink < 1:
        raise QuantizationError(f"max_shrink must lie in [0, 1), got {max_shrink}")
    out_features, in_features = weight.shape
    group_len = check_group_size(in_features, group_size)
    n_groups = in_features // group_len
    w = weight.to(torch.float32)
    x2 = x.reshape(-1, in_features)
    if x2.shape[0] > max_tokens:
        rows = torch.linspace(0, x2.shape[0] - 1, max_tokens, device=x2.device).round().long()
        x2 = x2[rows]
    x64 = x2.to(torch.float64)
    # A group's error sum_t (x_g . d_g)^2 is d_g^T (X_g^T X_g) d_g: one small Gram matrix per
    # group, computed once, replaces a tokens x out x groups product per candidate ratio.
    xg = x64.reshape(-1, n_groups, group_len)
    gram = torch.einsum("tgk,tgl->gkl", xg, xg)
    ones = torch.ones(out_features, n_groups, device=w.device)  # CUDA weights: same device
    chunk = max(1, CLIP_CHUNK_ELEMENTS // max(1, in_features))

    unit = torch.ones(in_features, device=w.device)

    def difference(clip: torch.Tensor) -> torch.Tensor:
        return (w - dequantize(quantize_scaled(w, unit, bits, group_size, sym, clip=clip,
                                               scale_dtype=scale_dtype))).to(torch.float64)

    def per_group_error(clip: torch.Tensor) -> torch.Tensor:
        dg = difference(clip).reshape(out_features, n_groups, group_len)
        return torch.cat([torch.einsum("ogk,gkl,ogl->og", dg[o:o + chunk], gram,
                                       dg[o:o + chunk])
                          for o in range(0, out_features, chunk)])

    def row_error(clip: torch.Tensor) -> torch.Tensor:
        d = difference(clip)
        return torch.cat([(x64 @ d[o:o + chunk].t()).pow(2).sum(0)
                          for o in range(0, out_features, chunk)])

    best_err, row_err_unclipped = per_group_error(ones), row_error(ones)
    best_clip = ones.clone()
    for i in range(1, int(max_shrink * n_grid)):
        ratio = 1.0 - i / n_grid
        err = per_group_error(torch.full_like(ones, ratio))
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_clip = torch.where(better, torch.full_like(ones, ratio), best_clip)
    row_err = row_error(best_clip)
    worse = row_err > row_err_unclipped
    best_clip[worse] = 1.0
    return best_clip


def _check_weight(weight: torch.Tensor, scales: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise QuantizationError(f"expected a 2-D weight [out, in], got shape "
                                f"{tuple(weight.shape)}")
    if tuple(scales.shape) != (weight.shape[1],):
        raise QuantizationError(f"scales must have one entry per input channel "
                                f"({weight.shape[1]}), got shape {tuple(scales.shape)}")
    if not (scales > 0).all() or not torch.isfinite(scales).all():
        raise QuantizationError("AWQ scales must be finite and positive")


def scale_following_weights(weights: list[torch.Tensor], scales: torch.Tensor
                            ) -> list[torch.Tensor]:
    """W * s for each linear reading the scaled input (columns times s); new tensors."""
    for w in weights:
        _check_weight(w, scales)
    return [w * scales.to(w.dtype) for w in weights]


def fold_scales_into_norm(norm_weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The preceding RMSNorm's weight divided by s, so it emits x / s; a new tensor.

    Only for norms computing weight * normalized(x) (Llama, Qwen, SmolLM2). Norms that compute
    (1 + weight) * normalized(x) (Gemma) need weight' = (1 + weight) / s - 1 instead.
    """
    if tuple(norm_weight.shape) != tuple(scales.shape):
        raise QuantizationError(f"norm weight {tuple(norm_weight.shape)} and scales "
                                f"{tuple(scales.shape)} differ in shape")
    return norm_weight / scales.to(norm_weight.dtype)


def fold_scales_into_linear(prev_weight: torch.Tensor, scales: torch.Tensor,
                            prev_bias: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Divide the preceding linear's output rows (weight [in, *], and its bias) by s.

    Valid only when that linear's output reaches the scaled layer through per-channel linear
    maps: v_proj -> attention -> o_proj (attention mixes tokens, not channels) with as many kv
    heads as query heads, and up_proj -> (act(gate) * up) -> down_proj. With grouped-query
    attention v_proj has fewer output rows than o_proj has inputs; that is rejected here.
    """
    if prev_weight.dim() < 1 or prev_weight.shape[0] != scales.numel():
        raise QuantizationError(f"previous layer has {prev_weight.shape[0]} output rows but "
                                f"there are {scales.numel()} scales (grouped-query v_proj "
                                f"cannot be folded into o_proj)")
    view = (-1,) + (1,) * (prev_weight.dim() - 1)
    new_weight = prev_weight / scales.to(prev_weight.dtype).reshape(view)
    new_bias = None if prev_bias is None else prev_bias / scales.to(prev_bias.dtype)
    return new_weight, new_bias


@dataclass
class AWQResult:
    """One input group's AWQ quantization: the shared scales and one QuantizedWeight per linear.

    Store `quantized` (codes of W * s) and fold `scales` into the preceding op.
    """

    scales: torch.Tensor
    quantized: list[QuantizedWeight]
    clips: list[torch.Tensor | None]
    info: ScaleSearchInfo


def quantize_awq(weights: list[torch.Tensor], x: torch.Tensor, bits: int = 4,
                 group_size: int = 128, sym: bool = False, n_grid: int = 20,
                 clip_search: bool = True, max_shrink: float = 0.5,
                 mean_abs: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.float16) -> AWQResult:
    """Scale search, then (optionally) clip search per weight on W * s with input x / s."""
    scales, info = search_scales(weights, x, bits, group_size, sym, n_grid, mean_abs,
                                 scale_dtype)
    x_scaled = x.reshape(-1, x.shape[-1]).to(torch.float32) / scales
    quantized: list[QuantizedWeight] = []
    clips: list[torch.Tensor | None] = []
    for w in weights:
        clip = None
        if clip_search:
            clip = search_clip(w.to(torch.float32) * scales, x_scaled, bits, group_size, sym,
                               n_grid, max_shrink, scale_dtype)
        quantized.append(quantize_scaled(w, scales, bits, group_size, sym, clip, scale_dtype))
        clips.append(clip)
    return AWQResult(scales=scales, quantized=quantized, clips=clips, info=info)
