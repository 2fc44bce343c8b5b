"""Prefix cache: a radix tree over full KV blocks (SGLang's RadixAttention, block-granular).

Each node is one full block of `block_size` tokens, keyed by those tokens under its parent, so a
path from the root spells a token prefix and names the blocks holding its KV. A new request
reuses the longest matching path and computes only the rest. Nodes whose blocks no request
references are evicted leaf-first, least recently used first, when the pool runs dry.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]
    block_id: int
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    last_access: int = 0


class RadixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = RadixNode((), -1, None)
        self.node_of_block: dict[int, RadixNode] = {}
        self._clock = itertools.count(1)
        # Eviction candidates: a min-heap of (last_access when pushed, tiebreak, node). Every
        # leaf has at least one entry; entries go stale (the node was touched since, gained a
        # child, or left the tree) and are fixed or dropped when popped, so an eviction costs
        # O(log n) per block instead of a scan of every cached node.
        self._leaf_heap: list[tuple[int, int, RadixNode]] = []
        self._tiebreak = itertools.count()
        self.query_tokens = 0  # hit-rate accounting, over prompt tokens looked up
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self.node_of_block)

    def _blocks_of(self, tokens: Sequence[int]):
        bs = self.block_size
        for i in range(len(tokens) // bs):
            yield tuple(tokens[i * bs:(i + 1) * bs])

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `tokens` (whole blocks only)."""
        return self.match_keys(list(self._blocks_of(tokens)))

    def match_keys(self, keys: Sequence[tuple[int, ...]]) -> list[int]:
        """`match_prefix` on precomputed block keys (a sequence caches its own)."""
        node, blocks, now = self.root, [], next(self._clock)
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            blocks.append(child.block_id)
            node = child
        return blocks

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one request's prompt lookup towards the hit rate."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def insert(self, tokens: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        """Record that block_ids[i] holds block i of `tokens`. Returns the ids that became
        cached; a block whose prefix is already cached under another id stays uncached."""
        return self.insert_keys(list(self._blocks_of(tokens)), block_ids)

    def insert_keys(self, keys: Sequence[tuple[int, ...]], block_ids: Sequence[int]) -> list[int]:
        node, added, now = self.root, [], next(self._clock)
        for key, block_id in zip(keys, block_ids):
            child = node.children.get(key)
            if child is None:
                if block_id in self.node_of_block:
                    break  # this block already caches another path (should not happen)
                child = RadixNode(key, block_id, node, last_access=now)
                node.children[key] = child
                self.node_of_block[block_id] = child
                self._push(child)  # a new node is a leaf
                added.append(block_id)
            child.last_access = now
            node = child
        return added

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.node_of_block

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._leaf_heap, (node.last_access, next(self._tiebreak), node))

    def _compact(self) -> None:
        """Rebuild the heap from the current leaves (stale entries piled up)."""
        self._leaf_heap = [(n.last_access, next(self._tiebreak), n)
                           for n in self.node_of_block.values() if not n.children]
        heapq.heapify(self._leaf_heap)

    def evict(self, num_blocks: int, is_free: Callable[[int], bool]) -> list[int]:
        """Remove up to num_blocks unreferenced leaves, oldest first; returns their block ids.
        A parent whose last child goes becomes a leaf and may go too."""
        if len(self._leaf_heap) > 2 * len(self.node_of_block) + 64:
            self._compact()
        heap, evicted, held = self._leaf_heap, [], []
        while heap and len(evicted) < num_blocks:
            stamp, _, node = heapq.heappop(heap)
            if self.node_of_block.get(node.block_id) is not node or node.children:
                continue  # gone, or no longer a leaf (pushed again when it becomes one)
            if stamp != node.last_access:
                self._push(node)  # touched since: its place in the LRU order moved
                continue
            if not is_free(node.block_id):
                held.append(node)  # referenced: a candidate again once released
                continue
            parent = node.parent
            del parent.children[node.key]
            del self.node_of_block[node.block_id]
            evicted.append(node.block_id)
            if parent is not self.root and not parent.children:
                self._push(parent)
        for node in held:
            self._push(node)
        return evicted

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
