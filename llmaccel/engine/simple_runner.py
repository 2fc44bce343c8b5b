"""A minimal batched generator over a contiguous KV cache: prefill everything, then decode.

It exists so the model and `llmaccel generate` work before the paged engine (scheduler, block
manager, prefix cache) lands; the cache already uses the paged layout, with each sequence
owning consecutive blocks.
"""

from __future__ import annotations

import math

import torch

from llmaccel.engine.sampler import make_generator, sample
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.transformer import TransformerForCausalLM

BLOCK_SIZE = 16


def allocate_kv_caches(model: TransformerForCausalLM, num_blocks: int,
                       block_size: int = BLOCK_SIZE) -> list[torch.Tensor]:
    p = next(model.parameters())
    return [torch.zeros(2, num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=p.dtype,
                        device=p.device) for a in model.attention_layers()]


@torch.inference_mode()
def generate_tokens(model: TransformerForCausalLM, prompts: list[list[int]],
                    params: SamplingParams, eos_token_ids: set[int] | None = None,
                    max_model_len: int | None = None) -> list[list[int]]:
    """Generate for every prompt in one batch; returns the new token ids of each."""
    device = next(model.parameters()).device
    limit = max_model_len or model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.shape[0]
    for p in prompts:
        if not p:
            raise ValueError("empty prompt")
        if len(p) + params.max_tokens > limit:
            raise ValueError(f"prompt of {len(p)} tokens + max_tokens={params.max_tokens} "
                             f"exceeds the context length {limit}")
    blocks_per_seq = [math.ceil((len(p) + params.max_tokens) / BLOCK_SIZE) for p in prompts]
    starts = [sum(blocks_per_seq[:i]) for i in range(len(prompts))]
    tables = [list(range(s, s + n)) for s, n in zip(starts, blocks_per_seq)]
    model.bind_kv_caches(allocate_kv_caches(model, sum(blocks_per_seq)))
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else (eos_token_ids or set()))
    gens = [make_generator(None if params.seed is None else params.seed + i, device)
            for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    feed = {i: list(p) for i, p in enumerate(prompts)}  # tokens to run through the model
    try:
        while active:
            lens = [len(prompts[i]) + len(outputs[i]) for i in active]
            query = [len(feed[i]) for i in active]
            positions = [pos for i, n, q in zip(active, lens, query) for pos in range(n - q, n)]
            slots = [tables[i][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                     for i, n, q in zip(active, lens, query) for pos in range(n - q, n)]
            meta = AttentionMetadata.build(query, lens, device, slots, [tables[i] for i in active])
            ids = torch.tensor([t for i in active for t in feed[i]], device=device)
            hidden = model(ids, torch.tensor(positions, device=device), meta)
            logits = model.compute_logits(hidden[meta.last_token_indices])
            tokens = sample(logits, [params] * len(active), [gens[i] for i in active]).tolist()
            still = []
            for i, tok in zip(active, tokens):
                outputs[i].append(tok)
                feed[i] = [tok]
                if tok not in stop and len(outputs[i]) < params.max_tokens:
                    still.append(i)
            active = still
    finally:
        model.bind_kv_caches(None)
    return outputs
