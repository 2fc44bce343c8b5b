"""SamplingParams, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmaccel.errors import LLMAccelError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0      # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1               # -1: no top-k cut
    max_tokens: int = 16
    seed: int | None = None       # per-request seed: same output whatever else is batched
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise LLMAccelError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LLMAccelError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise LLMAccelError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise LLMAccelError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
