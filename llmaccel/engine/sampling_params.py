"""SamplingParams, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmaccel.errors import LLMAccelError


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                    # completions per prompt (they share the prompt's KV blocks)
    temperature: float = 1.0      # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1               # 0 or -1: no top-k cut
    min_p: float = 0.0            # drop tokens below min_p * p(most likely token)
    seed: int | None = None       # per-request seed: same output whatever else is batched
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16   # None: up to the context length
    min_tokens: int = 0           # EOS and stop tokens are masked until this many were made
    logprobs: int | None = None   # also return the top-k logprobs of each generated token
    skip_special_tokens: bool = True
    # vLLM's RequestOutputKind: "cumulative" reports every step (streaming); "final_only"
    # only the finished request (LLM.generate), which spares building outputs every step.
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.output_kind in ("cumulative", "final_only"),
             f"output_kind must be 'cumulative' or 'final_only', got {self.output_kind!r}"),
            (self.logprobs is None or self.logprobs >= 0,
             f"logprobs must be >= 0, got {self.logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise LLMAccelError(message)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if self.stop and any(not s for s in self.stop):
            raise LLMAccelError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
