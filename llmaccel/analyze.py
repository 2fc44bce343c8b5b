"""Structural analysis of a model from its config: where the parameters are, what the weights
and KV cache cost at each precision, and how fast batch-1 decode can go on a given GPU.

Batch-1 decode is memory-bound: each token reads every weight once, so tok/s <= bandwidth /
bytes read per token. That ceiling (the roofline) is what kernels are judged against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from transformers import PretrainedConfig

from llmaccel.errors import LLMAccelError

# Datasheet memory bandwidth, GB/s (10^9 bytes/s).
GPU_BANDWIDTH_GBPS = {
    "T4": 320.0, "L4": 300.0, "RTX 3090": 936.0, "A100-40GB": 1555.0, "A100-80GB": 2039.0,
    "H100 SXM": 3350.0, "H200": 4800.0,
}
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KV_TOKENS_PER_REQUEST = 1024
GROUP_SIZE = 128


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per linear weight plus per-output-channel / per-group overheads. Embeddings,
    the LM head, norms and biases stay 16-bit in every format, as vLLM, GPTQ and AWQ keep them."""
    name: str
    bytes_per_weight: float
    bytes_per_channel: float = 0.0  # e.g. a per-channel scale
    bytes_per_group: float = 0.0    # e.g. scale + packed zero per group of GROUP_SIZE inputs


FORMATS = (
    WeightFormat("bf16", 2.0),
    WeightFormat("int8", 1.0, bytes_per_channel=2.0),             # W8A16, bf16 scale per row
    WeightFormat("int4-g128", 0.5, bytes_per_group=2.0 + 0.5),    # bf16 scale + 4-bit zero
    WeightFormat("fp8", 1.0, bytes_per_channel=4.0),              # E4M3, fp32 scale per row
)


def _dims(c: PretrainedConfig) -> dict[str, int]:
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return {"hidden": c.hidden_size, "inter": c.intermediate_size, "heads": heads,
            "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": head_dim, "layers": c.num_hidden_layers, "vocab": c.vocab_size}


def linear_shapes(c: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of one decoder layer."""
    d = _dims(c)
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    return {"q_proj": (d["hidden"], q), "k_proj": (d["hidden"], kv), "v_proj": (d["hidden"], kv),
            "o_proj": (q, d["hidden"]), "gate_proj": (d["hidden"], d["inter"]),
            "up_proj": (d["hidden"], d["inter"]), "down_proj": (d["inter"], d["hidden"])}


def _biases(c: PretrainedConfig) -> dict[str, bool]:
    attn = bool(getattr(c, "attention_bias", False))
    qkv = c.model_type == "qwen2" or attn
    mlp = bool(getattr(c, "mlp_bias", False))
    return {"q_proj": qkv, "k_proj": qkv, "v_proj": qkv, "o_proj": attn,
            "gate_proj": mlp, "up_proj": mlp, "down_proj": mlp}


def parameter_counts(c: PretrainedConfig) -> dict[str, Any]:
    d = _dims(c)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    per_layer = {name: i * o + (o if _biases(c)[name] else 0)
                 for name, (i, o) in linear_shapes(c).items()}
    per_layer["input_layernorm"] = per_layer["post_attention_layernorm"] = d["hidden"]
    embed = d["vocab"] * d["hidden"]
    other = {"embed_tokens": embed, "lm_head": 0 if tied else embed, "norm": d["hidden"]}
    layers_total = sum(per_layer.values()) * d["layers"]
    return {"layers": d["layers"], "tie_word_embeddings": tied,
            "per_layer": dict(sorted(per_layer.items(), key=lambda kv: -kv[1])),
            "other": other, "total_layers": layers_total,
            "total": layers_total + sum(other.values())}


def weight_bytes(c: PretrainedConfig, fmt: WeightFormat) -> dict[str, float]:
    """Bytes of all weights (`total`) and read per batch-1 decode step (`decode_read`)."""
    counts = parameter_counts(c)
    linear = 0.0
    for i, o in linear_shapes(c).values():
        linear += (i * o * fmt.bytes_per_weight + o * fmt.bytes_per_channel
                   + o * -(-i // GROUP_SIZE) * fmt.bytes_per_group)
    linear *= counts["layers"]
    linear_params = sum(i * o for i, o in linear_shapes(c).values()) * counts["layers"]
    sixteen_bit = (counts["total"] - linear_params) * 2.0
    total = linear + sixteen_bit
    # Decode looks up one embedding row; an untied table is not read in full, a tied one is
    # (as the LM head).
    untied_embed = 0.0 if counts["tie_word_embeddings"] else counts["other"]["embed_tokens"] * 2.0
    return {"total": total, "decode_read": total - untied_embed}


def kv_bytes_per_token(c: PretrainedConfig, bytes_per_value: float = 2.0) -> float:
    d = _dims(c)
    return 2 * d["layers"] * d["kv_heads"] * d["head_dim"] * bytes_per_value


def resolve_bandwidth(gpu: str | None, bandwidth_gbps: float | None) -> dict[str, float]:
    """GPU name(s) -> GB/s. With neither given, every datasheet GPU."""
    if bandwidth_gbps is not None:
        if bandwidth_gbps <= 0:
            raise LLMAccelError(f"--bandwidth must be positive, got {bandwidth_gbps}")
        return {f"{bandwidth_gbps:g} GB/s": bandwidth_gbps}
    if gpu is None:
        return dict(GPU_BANDWIDTH_GBPS)
    key = gpu.lower().replace(" ", "").replace("-", "").replace("_", "")
    for name, bw in GPU_BANDWIDTH_GBPS.items():
        if name.lower().replace(" ", "").replace("-", "") in (key, key + "sxm"):
            return {name: bw}
    raise LLMAccelError(f"unknown GPU '{gpu}' (known: {', '.join(GPU_BANDWIDTH_GBPS)}; or pass "
                        "--bandwidth GB/s)")


def analyze_config(c: PretrainedConfig, *, gpu: str | None = None,
                   bandwidth_gbps: float | None = None, context: int = 0) -> dict[str, Any]:
    """Everything `llmaccel analyze` shows, as plain data (the --json output)."""
    counts = parameter_counts(c)
    kv_tok = kv_bytes_per_token(c)
    memory = {f.name: weight_bytes(c, f) for f in FORMATS}
    gpus = resolve_bandwidth(gpu, bandwidth_gbps)
    roofline = {
        name: {fmt: bw * 1e9 / (m["decode_read"] + kv_tok * context) for fmt, m in memory.items()}
        for name, bw in gpus.items()}
    return {
        "architecture": (getattr(c, "architectures", None) or [c.model_type])[0],
        "dims": _dims(c), "parameters": counts,
        "weight_memory_bytes": {k: v["total"] for k, v in memory.items()},
        "decode_bytes_per_token": {k: v["decode_read"] for k, v in memory.items()},
        "kv_cache": {"bytes_per_token_bf16": kv_tok, "bytes_per_token_fp8": kv_tok / 2,
                     "tokens_per_request": KV_TOKENS_PER_REQUEST,
                     "bytes_per_request_bf16": kv_tok * KV_TOKENS_PER_REQUEST},
        "roofline": {"context_tokens": context, "bandwidth_gbps": gpus, "tok_s": roofline},
        "formats": [asdict(f) for f in FORMATS], "group_size": GROUP_SIZE,
    }
