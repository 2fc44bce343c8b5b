"""Tree verification: a chain of drafts plus, at each depth, the proposer's next-best tokens as
leaves (SGLang's `speculative_eagle_topk`; `SpeculativeConfig.draft_topk`).

A draft head proposes its top-1 token at every depth and goes on from it (the chain). Its
runners-up at the same depth cost nothing more to propose (the same logits), and when the
chain is rejected at depth d, the target's token at d is often among them. Verified as leaves
of the tree, one of them matching gives one more accepted token and the target's token after
it (its row's argmax): one token more per such round, for extra rows in a verify step that is
memory-bound at small batches.

Layout of one sequence's verify rows (greedy only): the last real token t0 at position p, the
chain d_1..d_k at p + 1..p + k, then the siblings, depth by depth, `width` = topk - 1 per
depth: sibling (j, r) of depth j (1-based) sits at position p + j (its rotary position), but
in the KV slot of the row's own position in the step, p + k + 1 + (j - 1) * width + r, since
d_j holds p + j's slot. Its attention reads positions up to p + j - 1 through the block table
(t0 and d_1..d_{j-1}: its ancestors) and its own key from its slot
(`AttentionMetadata.newest_key_from_slot`): exactly its path in the tree.

After verification, an accepted sibling's KV (and its feature, for a head) moves from its slot
to the slot of position p + j (`ModelRunner.move_slots`), where the next steps read it.
"""

from __future__ import annotations

from collections.abc import Sequence


def sibling_depth(index: int, width: int) -> int:
    """Depth (1-based) of the sibling at flat `index` with `width` siblings per depth."""
    return 1 + index // width


def sibling_positions(p: int, num_siblings: int, width: int) -> list[int]:
    """Rotary positions of a sequence's sibling rows (t0 at position p)."""
    return [p + sibling_depth(i, width) for i in range(num_siblings)]


def greedy_verify_tree(chains: Sequence[Sequence[int]], siblings: Sequence[Sequence[int]],
                       widths: Sequence[int], argmax: Sequence[float],
                       offsets: Sequence[int]
                       ) -> tuple[list[list[int]], list[int], list[int]]:
    """Greedy verification of chains with sibling leaves, from the target's argmax per verify
    row (row offsets[b] + j follows t0 and d_1..d_j; the siblings' rows follow the chain's, in
    their flat order). Per sequence: the emitted tokens (accepted drafts, then the target's
    token), the accepted count, and the flat index of the accepted sibling (-1: none).

    The chain is accepted while d_j equals the argmax at row j - 1; at the first mismatch,
    depth a + 1, a sibling of that depth equal to the argmax there is accepted too, and the
    token after it is its own row's argmax. A sequence without siblings is verified as a
    chain (spec/verifier.greedy_verify_rows)."""
    tokens, accepted, picked = [], [], []
    for chain, sibs, width, o in zip(chains, siblings, widths, offsets):
        k = len(chain)
        a = 0
        while a < k and chain[a] == int(argmax[o + a]):
            a += 1
        want = int(argmax[o + a])
        pick = -1
        if a < k and sibs:
            for r in range(width):
                i = a * width + r
                if i < len(sibs) and sibs[i] == want:
                    pick = i
                    break
        if pick < 0:
            tokens.append(list(chain[:a]) + [want])
            accepted.append(a)
        else:
            row = o + 1 + k + pick
            tokens.append(list(chain[:a]) + [sibs[pick], int(argmax[row])])
            accepted.append(a + 1)
        picked.append(pick)
    return tokens, accepted, picked
