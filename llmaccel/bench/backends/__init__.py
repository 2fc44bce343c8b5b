"""Backends `llmaccel bench` measures: `llmaccel` (our engine in process), `hf-eager` /
`hf-static-compile` (transformers' generate), `openai:<name>` (any OpenAI-compatible
server: ours, vLLM, SGLang)."""

from llmaccel.bench.backends.base import Backend, BenchRequest, TokenClock, failed

__all__ = ["Backend", "BenchRequest", "TokenClock", "failed"]
