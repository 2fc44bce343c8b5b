"""Adaptive speculation: how many tokens to draft for a request, from its recent acceptance.

If each draft is accepted with probability a (independently, the usual model), a step with k
drafts emits E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs 1 + k c target-step units, where
c is a draft step's cost relative to a target step (about 0 for n-gram lookup, 0.1-0.8 for a
draft model on a GPU). The best k maximizes E(k) / (1 + k c); k = 0 (no speculation) wins when
a is low, which is how speculation switches itself off for requests it does not help. On a GPU
the cost is measured per batch size instead of 1 + k c (spec/costs.py), which also prices the
verify step itself: at large batches it is no longer free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmaccel.spec.costs import constant_cost_fn


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits with k drafts, each accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup_bound(alpha: float, k: int, cost_ratio: float) -> float:
    """E(k) / (1 + k c): the speedup over plain decoding these numbers allow (the bound)."""
    return expected_tokens(alpha, k) / (1.0 + k * cost_ratio)


def best_k(alpha: float, cost: float | Callable[[int], float], k_max: int) -> int:
    """The k in 0..k_max with the most tokens per unit of step cost, E(k) / cost(k) (the
    smallest on ties). `cost`: a function of k (spec/costs.py: measured at a batch size), or
    a draft cost ratio c for the constant model 1 + k c."""
    fn = cost if callable(cost) else constant_cost_fn(cost)
    return max(range(k_max + 1), key=lambda k: (expected_tokens(alpha, k) / fn(k), -k))


@dataclass
class AcceptanceTracker:
    """One request's acceptance rate, as exponentially decayed counts of accepted drafts and
    rejections (the maximum-likelihood rate of the geometric model is accepted / (accepted +
    rejections)); starts from a prior worth a few steps so the first steps speculate."""

    decay: float = 0.8
    accepted: float = 3.0  # prior: acceptance 0.75 over ~4 drafts
    rejected: float = 1.0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1 if num_accepted < num_draft else 0)

    def next_k(self, cost: float | Callable[[int], float], k_max: int, min_k: int = 1) -> int:
        """The k to draft next (`cost` as in `best_k`); at least `min_k` so a request that
        stopped speculating keeps probing (with k = 0 it would never see an acceptance
        again)."""
        return max(min_k, best_k(self.alpha, cost, k_max))
