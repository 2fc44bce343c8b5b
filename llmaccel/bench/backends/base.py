"""The one interface `llmaccel bench` measures through: a backend takes a request, streams the
answer, and returns what its client saw (`RequestResult`). In-process engines, HF
transformers and any OpenAI-compatible server all look alike to the load generator."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from llmaccel.bench.metrics import RequestResult


@dataclass(frozen=True)
class BenchRequest:
    """A prompt (token ids for the random-token workloads, or text) and how much to make.
    Greedy; `ignore_eos` so every request produces exactly `max_tokens`."""
    prompt: list[int] | str
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = True


class Backend(abc.ABC):
    """One system under test. `start` loads or connects (outside the timed region);
    `generate` must never raise for a failed request: it returns success=False with the
    error, so failures are counted rather than lost."""

    name: str = "?"
    # Requests the backend can run at once; None is unbounded. A backend without batching
    # (HF generate) says 1, and the load generator queues the rest on the client side.
    max_concurrency: int | None = None

    async def start(self) -> None:  # noqa: B027 - optional hook
        pass

    @abc.abstractmethod
    async def generate(self, request: BenchRequest) -> RequestResult:
        ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def vocab_size(self) -> int | None:
        """For random-token prompts; None when the backend cannot tell (a remote server)."""
        return None

    def facts(self) -> dict[str, Any]:
        """What a record's config should say about this backend (engine, dtype, url...)."""
        return {}

    def roofline_inputs(self) -> tuple[Any, Any, Any] | None:
        """(module, hf_config, dtype) of a local model, for achieved GB/s; None if remote."""
        return None

    async def engine_stats(self) -> dict[str, Any] | None:
        """Engine counters after a run (speculation, preemptions, prefix hits), if known."""
        return None

    @property
    def load_format(self) -> str:
        """What records call the weights: gguf / safetensors / dummy, or remote."""
        return "remote"

    def device(self) -> str | None:
        """The local device name (for records), or None for a remote server."""
        return None


def failed(request: BenchRequest, start: float, error: BaseException | str) -> RequestResult:
    text = error if isinstance(error, str) else (f"{type(error).__name__}: {error}".strip())
    return RequestResult(success=False, prompt_len=request.prompt_len, start=start,
                         error=" ".join(text.split())[:500])


class TokenClock:
    """Turns chunk arrivals into TTFT, inter-chunk gaps and E2E latency."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.last: float | None = None

    def chunk(self, now: float) -> None:
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now

    def result(self, request: BenchRequest, output_len: int, text: str = "") -> RequestResult:
        if self.last is None or output_len == 0:
            return failed(request, self.start, "no output tokens")
        return RequestResult(success=True, prompt_len=request.prompt_len,
                             output_len=output_len, start=self.start, ttft=self.ttft,
                             itl=self.itl, latency=self.last - self.start, generated_text=text)
