"""Our Transformer against transformers' implementation on the same weights (fp32, CPU)."""

import random

import pytest
import torch

from llmaccel.engine.kv_cache import allocate_kv_caches
from llmaccel.models.attention import AttentionMetadata
from llmaccel.models.loader import load_model
from tiny_models import make_tiny_model, tiny_configs

LENGTHS = [7, 1, 23, 12]


@pytest.fixture(scope="module", params=list(tiny_configs()))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(tiny_configs()[request.param], directory)
    _, ours = load_model(str(directory), dtype="float32", device="cpu")
    return hf, ours


def _hf_logits(hf, seqs):
    with torch.no_grad():
        return torch.cat([hf(s[None]).logits[0] for s in seqs])


def test_prefill_logits_match_transformers(pair):
    hf, ours = pair
    seqs = [torch.randint(0, hf.config.vocab_size, (n,)) for n in LENGTHS]
    meta = AttentionMetadata.for_prefill(LENGTHS, "cpu")
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    with torch.no_grad():
        logits = ours.compute_logits(ours(torch.cat(seqs), positions, meta))
    torch.testing.assert_close(logits, _hf_logits(hf, seqs), atol=1e-4, rtol=0)


def test_paged_kv_chunks_match_transformers(pair):
    """Each sequence goes through the KV cache in uneven chunks (prefill pieces, then single
    decode tokens), all sequences batched together each step, with scattered block tables."""
    hf, ours = pair
    rng = random.Random(0)
    block_size, num_blocks = 4, 64
    seqs = [torch.randint(0, hf.config.vocab_size, (n,)) for n in LENGTHS]
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-n // block_size))] for n in LENGTHS]
    ours.bind_kv_caches(allocate_kv_caches(ours, num_blocks, block_size, torch.float32, "cpu"))
    done = [0] * len(seqs)
    got = [[] for _ in seqs]
    try:
        while any(d < len(s) for d, s in zip(done, seqs)):
            active = [i for i, s in enumerate(seqs) if done[i] < len(s)]
            chunks = {i: min(len(seqs[i]) - done[i], rng.choice([1, 1, 3, 5])) for i in active}
            ids, pos, slots = [], [], []
            for i in active:
                for p in range(done[i], done[i] + chunks[i]):
                    ids.append(seqs[i][p])
                    pos.append(p)
                    slots.append(tables[i][p // block_size] * block_size + p % block_size)
            meta = AttentionMetadata.build([chunks[i] for i in active],
                                           [done[i] + chunks[i] for i in active], "cpu", slots,
                                           [tables[i] for i in active])
            with torch.no_grad():
                logits = ours.compute_logits(ours(torch.stack(ids), torch.tensor(pos), meta))
            for i, part in zip(active, logits.split([chunks[i] for i in active])):
                got[i].append(part)
                done[i] += chunks[i]
    finally:
        ours.bind_kv_caches(None)
    torch.testing.assert_close(torch.cat([torch.cat(g) for g in got]), _hf_logits(hf, seqs),
                               atol=1e-4, rtol=0)


def test_bf16_load_keeps_bf16(tmp_path):
    make_tiny_model(tiny_configs()["qwen2"], tmp_path)  # saved in fp32
    mc, model = load_model(str(tmp_path), dtype="bfloat16", device="cpu")
    assert mc.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
