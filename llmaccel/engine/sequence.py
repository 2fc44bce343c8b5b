"""A sequence: one stream of tokens being generated, and what the engine knows about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from llmaccel.engine.detokenizer import DetokenizerState
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.spec.adaptive import AcceptanceTracker
from llmaccel.spec.metrics import SpecDecodeStats


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int                       # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_published_blocks: int = 0    # leading blocks already in the prefix cache
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    num_cached_tokens: int = 0       # of the prompt, served from the prefix cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    text: str = ""
    detokenizer: DetokenizerState = field(default_factory=DetokenizerState)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    # speculative decoding: drafts to verify in the next step (not part of the output yet)
    spec_token_ids: list[int] = field(default_factory=list)
    # tree verification (spec/tree.py): the proposer's runners-up at each draft depth, verified
    # as leaves, `spec_sibling_width` per depth, flat (empty: a plain chain)
    spec_sibling_ids: list[int] = field(default_factory=list)
    spec_sibling_width: int = 0
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    spec_tracker: AcceptanceTracker | None = None  # recent acceptance, for the adaptive k
    spec_draft_probs: torch.Tensor | None = None  # [k, vocab] q of sampled drafts (draft model)
    # logprobs of the tokens of the last verified step (several): a stop string found in
    # them ends the output at its token, and the tokens after it leave the cumulative logprob
    last_step_logprobs: list[float] = field(default_factory=list)
    draft_view: object | None = None  # the draft model's KV state (spec/draft_model.DraftView)
    ngram_index: object | None = None  # n-gram -> latest end, for n-gram lookup (spec/ngram)
    _block_keys: list[tuple[int, ...]] = field(default_factory=list, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (it grows every step)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def block_keys(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """Token tuples of the first num_blocks full blocks: the prefix cache's keys, built
        once per block (a sequence's tokens only ever grow)."""
        keys = self._block_keys
        for i in range(len(keys), num_blocks):
            keys.append(tuple(self.token_slice(i * block_size, (i + 1) * block_size)))
        return keys[:num_blocks]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
