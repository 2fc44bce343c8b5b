"""Batch-1 decode layers without RMSNorm kernels, for int4 models on the CUDA C GEMV.

A decoder layer's unfused batch-1 decode runs two RMSNorm kernels (add the sub-layer's output
to the residual stream, then normalize), each a short serial kernel on the step's critical
path: 57 of them took 83 us of a 1,103 us llama-3.2-3b GPTQ int4 step on an H100
(2026-11-27 profile, `benchmarks/profile_step_gaps.py`). Folding the norm into the next
GEMV's prologue was slower, because every block then summed the whole row's squares again
(2026-11-26-w4-cuda-gemv-h100.md). Here the GEMV that writes the residual stream (o and
down, residual add in the epilogue) also leaves the row's sum of squares in 32 fp64 slots
(each block adds its rows' squares with one atomic), and the next GEMV (gate_up, or the next
layer's qkv) reads the 32 slots and normalizes its input in the prologue without a block
reduction (`kernels/csrc/gemv_w4.cu`, PROLOGUE 3 and STATS_OUT).

The stream stays in one tensor updated in place, as in `DecoderLayer.forward_fused`. Slot
sets, one per norm (`new_norm_stats`): S[2i] for layer i's post-attention norm (written by
its o GEMV, read by its gate_up GEMV), S[2i + 1] for layer i + 1's input norm (written by
layer i's down GEMV, read by layer i + 1's qkv GEMV). Each set is zeroed again by the second
kernel after its reader (down zeroes S[2i], the next o zeroes S[2i + 1]): the reader has
finished by then under programmatic dependent launch (kernels/pdl.py). So every set is zero
between steps. Layer 0's input norm and the final norm stay RMSNorm kernels (no GEMV before
them). The o and down GEMVs read the stream's old values before their PDL wait: the last
kernel that wrote them ran three (o) or two (down) launches earlier.

Off by default, measured slower: LLMACCEL_NORM_STATS=1 turns it on. W1 on llama-3.2-3b,
GPTQ int4 + int4 head, H100, each against off in one call (2026-11-27-s28-int4-w1-h100.md):
836.9 against 899.4 tok/s (aeaa18e; decode 851.2 against 915.9), and 847.3 against 899.7
with one copy of the norm weight in registers (fe8857e). The gate_up GEMV lost more (12.3 ->
17.4 us a call: 4,096 blocks each redoing per-input work, and more registers) than the norm
kernels saved.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("LLMACCEL_NORM_STATS", "0") == "1"


def _layer_takes(layer, x: torch.Tensor) -> bool:
    """Every product of `layer` takes the norm-statistics GEMVs for rows like `x`, its norms
    and rope run on the kernels, and the qkv GEMV can rotate and write the cache."""
    from llmaccel.models.layers import quantization

    attn, mlp = layer.self_attn, layer.mlp
    if not quantization.QKV_ROPE_EPILOGUE:  # the qkv GEMV must write the cache
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(hasattr(lin.quant_method, "takes_norm_stats") for lin in linears):
        return False
    inputs = (x, x.new_empty(1, attn.q_size), x, x.new_empty(1, mlp.down_proj.input_size))
    sizes = mlp.gate_up_proj.output_sizes
    return (layer.fuse_decode and layer.input_layernorm.use_triton
            and layer.post_attention_layernorm.use_triton and attn.rotary_emb.use_triton
            and getattr(attn.backend, "fuse_rope_cache", False)
            and attn.rotary_emb.cos_sin_cache.shape[-1] == attn.head_dim
            and len(sizes) == 2 and sizes[0] == sizes[1]
            and all(lin.quant_method.takes_norm_stats(lin, t) for lin, t in zip(linears, inputs)))


def step_takes(model, x: torch.Tensor, meta) -> bool:
    """Whether `model` (a TransformerModel) runs this step's layers here: one decode token,
    every layer able to (decided once per dtype and device, `_norm_stats_ok`), a cache in the
    activations' dtype (the qkv GEMV writes it)."""
    if (not ENABLED or x.dim() != 2 or x.shape[0] != 1 or not meta.is_pure_decode
            or not meta.uses_kv_cache):
        return False
    from llmaccel.quant import linear_methods

    if linear_methods.FUSED_CUDA:  # its own fused layers, measured on their own
        return False
    key = (x.dtype, x.device)
    ok = model._norm_stats_ok.get(key)
    if ok is None:
        ok = model._norm_stats_ok[key] = all(_layer_takes(layer, x) for layer in model.layers)
    kv = model.layers[0].self_attn.kv_cache
    return ok and kv is not None and kv.dtype == x.dtype


def _stats(model, device: torch.device) -> torch.Tensor:
    from llmaccel.kernels.gemv_w4_cuda import new_norm_stats

    t = model._norm_stats_slots
    if t is None or t.device != device:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("norm statistics slots must exist before CUDA graph capture")
        t = model._norm_stats_slots = new_norm_stats(2 * len(model.layers), device)
    return t


def forward(model, positions: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
    """The layers of one decode token from the embedding output `x` (updated in place as the
    residual stream), then the final norm: `TransformerModel.forward` where `step_takes`."""
    stats = _stats(model, x.device)
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        _layer(layer, positions, x, meta, stats[2 * i - 1] if i else None, stats[2 * i],
               stats[2 * i + 1] if i < last else None)
    return model.norm(x)


def _layer(layer, positions, residual, meta, stats_in, stats_mid, stats_next) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    if stats_in is None:  # layer 0: the embedding output has no statistics yet
        q = attn._qkv_rope(positions, ln1(residual), meta)
    else:
        q = attn._qkv_rope(positions, residual, meta, norm_weight=ln1.weight, eps=ln1.eps,
                           norm_stats=stats_in)
    if q is None:
        raise RuntimeError(f"{attn.qkv_proj.prefix}: the qkv GEMV with rope did not run in a "
                           "norm-statistics decode layer")
    out = attn.backend.attend_cached(q.view(-1, attn.num_heads, attn.head_dim), attn.kv_cache,
                                     meta, attn.scale, attn.k_scale, attn.v_scale)
    o, gate_up, down = attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    o.quant_method.apply_norm_stats(o, out.reshape(1, attn.q_size), residual=residual,
                                    stats_out=stats_mid, stats_zero=stats_in,
                                    residual_early=True)
    act = gate_up.quant_method.apply_norm_stats(gate_up, residual, norm_weight=ln2.weight,
                                                eps=ln2.eps, norm_stats=stats_mid,
                                                silu_out=True)
    down.quant_method.apply_norm_stats(down, act, residual=residual, stats_out=stats_next,
                                       stats_zero=stats_mid, residual_early=True)
