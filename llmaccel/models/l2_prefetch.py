"""Which weights each batch-1 GEMV prefetches into L2 (`kernels/l2_prefetch.py`).

A decode step runs the linear layers in a fixed order: per decoder layer qkv, o, gate_up,
down; then the LM head; then the next step's first qkv. Each layer gets `l2_prefetch`, the
ranges of the next layer's weight and scales (cut to `cap_bytes()`), which its quantized
method's CUDA C GEMV passes to the kernel (int4: `quant/linear_methods.py`, FP8:
`quant/fp8_linear.py`). Layers whose batch-1 product is not one of those kernels (cuBLAS, the
Triton GEMVs) ignore it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmaccel.kernels.l2_prefetch import cap_bytes, ranges_of

logger = logging.getLogger(__name__)


def decode_order(model: nn.Module) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """(layer, the weight tensors its product streams) in a decode step's order; the LM head
    last (the embedding table where the head is tied to it)."""
    from llmaccel.models.layers.linear import Linear

    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            out.append((lin, streamed_weights(lin)))
    head = getattr(model, "lm_head", None)
    if isinstance(head, Linear):
        out.append((head, streamed_weights(head)))
    else:
        embed = model.model.embed_tokens
        out.append((embed, [embed.weight]))
    return out


def streamed_weights(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors a batch-1 product of `layer` reads, the small scales first (read scattered,
    one per group or row; a cap cuts the big tensor, not them): the int4 kernel layout
    (scales, codes; asymmetric zeros are not prefetched), FP8 (row scales, weight) or plain
    weights."""
    names = (("kernel_scales", "kernel_weight") if hasattr(layer, "kernel_weight")
             else ("weight_scale", "weight"))
    return [t for t in (getattr(layer, n, None) for n in names) if isinstance(t, torch.Tensor)]


def link_l2_prefetch(model: nn.Module, cap: int | None = None, cuda_only: bool = True) -> int:
    """Give every layer of the decode order the prefetch ranges of the one after it (the LM
    head: the first qkv, for the next step), up to `cap` bytes (default `cap_bytes()`).
    Returns the number of layers linked (0 off CUDA or with a cap of 0)."""
    cap = cap_bytes() if cap is None else cap
    order = decode_order(model)
    linked = 0
    for i, (layer, _) in enumerate(order):
        ranges = ranges_of(order[(i + 1) % len(order)][1], cap, cuda_only) if cap > 0 else ()
        layer.l2_prefetch = ranges
        linked += bool(ranges)
    if linked:
        logger.info("L2 prefetch: each batch-1 CUDA C GEMV prefetches the next layer's weights "
                    "(up to %.0f MiB)", cap / 2**20)
    return linked
