"""A tiny model decoding through the paged cache on the Triton path (fused decode layers on or
off) and on the torch reference path, step by step with the same tokens: the logits of both."""

from __future__ import annotations

from pathlib import Path

import torch

from llmaccel.engine.kv_cache import allocate_kv_caches
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.loader import load_model
from tiny_models import make_tiny_model, tiny_configs

PROMPTS = [5, 9, 3]
DECODE_STEPS = 3
BLOCK_SIZE = 4


def _run(model, device, steps):
    caches = allocate_kv_caches(model, 24, BLOCK_SIZE, torch.float32, device)
    model.bind_kv_caches(caches)
    # scattered, interleaved blocks: sequence i owns blocks i, i + 3, i + 6, ...
    tables = [[i + 3 * b for b in range(6)] for i in range(len(PROMPTS))]
    out = []
    try:
        for query_lens, seq_lens, ids in steps:
            slots, positions = [], []
            for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
                for p in range(n - q, n):
                    positions.append(p)
                    slots.append(tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            meta = AttentionMetadata.build(query_lens, seq_lens, device, slots, tables)
            with torch.no_grad():
                hidden = model(ids.to(device), torch.tensor(positions, device=device), meta)
                out.append(model.compute_logits(hidden).float().cpu())
    finally:
        model.bind_kv_caches(None)
    return out


def run_decode_case(tmp_path: Path, device: str, fuse: bool = True, family: str = "qwen2"):
    """(logits of ours on `device` with Triton kernels, logits of the torch reference on CPU),
    one tensor per step: a prefill of PROMPTS, then DECODE_STEPS batched decode steps."""
    make_tiny_model(tiny_configs()[family], tmp_path)
    _, ref = load_model(str(tmp_path), dtype="float32", device="cpu", attention_backend="torch")
    _, ours = load_model(str(tmp_path), dtype="float32", device=device,
                         attention_backend="triton")
    ours.set_fused_kernels(True, fuse_decode=fuse)
    gen = torch.Generator().manual_seed(0)
    vocab = ref.config.vocab_size
    steps = [(PROMPTS, PROMPTS, torch.randint(0, vocab, (sum(PROMPTS),), generator=gen))]
    for s in range(1, DECODE_STEPS + 1):
        steps.append(([1] * len(PROMPTS), [n + s for n in PROMPTS],
                      torch.randint(0, vocab, (len(PROMPTS),), generator=gen)))
    return _run(ours, device, steps), _run(ref, "cpu", steps)
