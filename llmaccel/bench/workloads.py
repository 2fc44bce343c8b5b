"""Seeded random-token prompts for the docs/workloads.md workloads W1-W4.

Python's `random.Random` draws the tokens, so a seed gives the same prompts on every machine and
torch version. Ids come from a safe band of the vocabulary: low ids and the top of the
vocabulary hold special tokens (Llama 3's start at 128000 of 128256), which a random prompt
should not contain.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class W1Spec:
    """Latency: batch-1 decode."""
    prompt_len: int = 128
    new_tokens: int = 256
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.new_tokens


@dataclass(frozen=True)
class W2Spec:
    """Offline throughput: every request submitted at once."""
    num_requests: int = 256
    input_min: int = 100
    input_max: int = 1024
    new_tokens: int = 512
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.input_max + self.new_tokens


@dataclass(frozen=True)
class W3Spec:
    """Serving: requests arrive over time (a rate or a concurrency, set per load point)."""
    num_prompts: int = 200
    input_min: int = 100
    input_max: int = 1024
    output_min: int = 50
    output_max: int = 512
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.input_max + self.output_max


@dataclass(frozen=True)
class W4Spec:
    """Shared prefix: one system prompt, a unique tail per request."""
    num_requests: int = 64
    prefix_len: int = 2000
    unique_len: int = 50
    new_tokens: int = 64
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.prefix_len + self.unique_len + self.new_tokens


# --quick: sizes a tiny model on a CPU gets through in seconds (tests, smoke runs).
QUICK_W1 = W1Spec(prompt_len=16, new_tokens=16)
QUICK_W2 = W2Spec(num_requests=4, input_min=8, input_max=48, new_tokens=8)
QUICK_W4 = W4Spec(num_requests=4, prefix_len=64, unique_len=8, new_tokens=4)
QUICK_W3 = W3Spec(num_prompts=8, input_min=8, input_max=48, output_min=4, output_max=12)


def specs(quick: bool = False) -> tuple[W1Spec, W2Spec, W4Spec]:
    return (QUICK_W1, QUICK_W2, QUICK_W4) if quick else (W1Spec(), W2Spec(), W4Spec())


def fit_to_length(spec: W1Spec | W2Spec | W3Spec | W4Spec, max_len: int):
    """Shrink a spec's prompt side so prompt + new tokens fit a model of `max_len` positions
    (tiny test models); the number of new tokens is kept."""
    over = spec.max_model_len - max_len
    if over <= 0:
        return spec
    if isinstance(spec, W1Spec):
        return replace(spec, prompt_len=max(1, spec.prompt_len - over))
    if isinstance(spec, (W2Spec, W3Spec)):
        top = max(1, spec.input_max - over)
        return replace(spec, input_max=top, input_min=min(spec.input_min, top))
    return replace(spec, prefix_len=max(1, spec.prefix_len - over))


def token_range(vocab_size: int) -> tuple[int, int]:
    """[lo, hi) of ids to draw from: 100 .. vocab - 1000 for real vocabularies, the same
    proportions (10% off each end at most) for tiny test vocabularies."""
    lo = min(100, vocab_size // 10)
    hi = vocab_size - min(1000, vocab_size // 10)
    if hi <= lo:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for random prompts")
    return lo, hi


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    lo, hi = token_range(vocab_size)
    return [rng.randrange(lo, hi) for _ in range(n)]


def w1_prompt(spec: W1Spec, vocab_size: int) -> list[int]:
    return _tokens(random.Random(spec.seed), spec.prompt_len, vocab_size)


def w2_prompts(spec: W2Spec, vocab_size: int) -> list[list[int]]:
    """Lengths U(input_min, input_max) inclusive, then the tokens, from one seeded stream."""
    rng = random.Random(spec.seed)
    lengths = [rng.randint(spec.input_min, spec.input_max) for _ in range(spec.num_requests)]
    return [_tokens(rng, n, vocab_size) for n in lengths]


def w3_requests(spec: W3Spec, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt, new tokens) pairs: input U(input_min, input_max), output U(output_min,
    output_max), inclusive, from one seeded stream."""
    rng = random.Random(f"w3-{spec.seed}")
    shapes = [(rng.randint(spec.input_min, spec.input_max),
               rng.randint(spec.output_min, spec.output_max)) for _ in range(spec.num_prompts)]
    return [(_tokens(rng, n_in, vocab_size), n_out) for n_in, n_out in shapes]


def w4_prefix(spec: W4Spec, vocab_size: int) -> list[int]:
    return _tokens(random.Random(f"w4-prefix-{spec.seed}"), spec.prefix_len, vocab_size)


def w4_prompts(spec: W4Spec, vocab_size: int, round_index: int = 0) -> list[list[int]]:
    """The shared prefix plus unique tails. Each round (warm-up, each timed repeat) draws new
    tails, so a repeat never hits tails a previous repeat left in the prefix cache."""
    prefix = w4_prefix(spec, vocab_size)
    rng = random.Random(f"w4-tails-{spec.seed}-{round_index}")
    return [prefix + _tokens(rng, spec.unique_len, vocab_size)
            for _ in range(spec.num_requests)]
