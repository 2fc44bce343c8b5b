"""RadixCache.evict keeps a heap of leaf candidates instead of scanning every cached node; on
random traces of inserts, lookups, references and evictions it must evict exactly what the
definition says: repeatedly the least recently used unreferenced leaf (a parent whose last
child goes becomes a leaf), computed here from a snapshot of the tree by brute force."""

from __future__ import annotations

import random

import pytest

from llmaccel.engine.radix_cache import RadixCache


def reference_evict(cache: RadixCache, k: int, held: set[int]) -> list[int]:
    nodes = {b: n for b, n in cache.node_of_block.items()}
    children = {b: len(n.children) for b, n in nodes.items()}
    out: list[int] = []
    while len(out) < k:
        leaves = [b for b in nodes if children[b] == 0 and b not in held]
        if not leaves:
            break
        b = min(leaves, key=lambda x: nodes[x].last_access)
        parent = nodes.pop(b).parent
        out.append(b)
        if parent is not cache.root:
            children[parent.block_id] -= 1
    return out


@pytest.mark.parametrize("seed", range(40))
def test_evictions_follow_lru_leaf_first(seed):
    rng = random.Random(seed)
    bs, vocab = rng.choice([1, 2, 3]), rng.choice([2, 3, 5])
    cache, next_id, held = RadixCache(bs), 0, set()
    evicted_total = 0
    for _ in range(300):
        r = rng.random()
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        if r < 0.4:
            matched = cache.match_prefix(toks)
            n = len(toks) // bs
            ids = matched + list(range(next_id, next_id + n - len(matched)))
            next_id += n - len(matched)
            cache.insert(toks, ids)
        elif r < 0.6:
            cache.match_prefix(toks)
        elif r < 0.75 and cache.node_of_block:
            held ^= {rng.choice(list(cache.node_of_block))}  # reference or release a block
        else:
            k = rng.randrange(1, 5)
            want = reference_evict(cache, k, held)
            got = cache.evict(k, lambda b: b not in held)
            assert got == want
            evicted_total += len(got)
            assert not set(got) & set(cache.node_of_block)
    assert evicted_total > 0
