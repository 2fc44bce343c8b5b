"""Backend `openai:<name>`: any OpenAI-compatible server (ours, vLLM, SGLang) through
`/v1/completions` or `/v1/chat/completions` with `stream: true`, timed per SSE chunk.

Output tokens are taken from the final `usage` chunk (`stream_options.include_usage`, which
vLLM and SGLang honour); a server that sends no usage has its chunks counted instead, and
the result says so (`token_count`). `ignore_eos` is the vLLM/SGLang extension that makes
every request produce `max_tokens`; a server without it may stop early, which the output
lengths then show.
"""

from __future__ import annotations

import json
import time
from typing import Any

from llmaccel.bench.backends.base import Backend, BenchRequest, TokenClock, failed
from llmaccel.bench.metrics import RequestResult

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class OpenAIBackend(Backend):
    def __init__(self, base_url: str, model: str, name: str = "server",
                 endpoint: str = "/v1/completions", api_key: str | None = None,
                 vocab: int | None = None, timeout_s: float = 600.0,
                 extra_body: dict[str, Any] | None = None) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        self.name = f"openai:{name}"
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.api_key = api_key
        self._vocab = vocab
        self.timeout_s = timeout_s
        self.extra_body = dict(extra_body or {})
        self.client = None
        self.counted_chunks = False  # set when a server sent no usage

    async def start(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # No connection cap: the load generator decides concurrency, not the client pool.
        self.client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(self.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.max_tokens,
                                "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if request.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint.endswith("chat/completions"):
            if not isinstance(request.prompt, str):
                raise ValueError("the chat endpoint needs text prompts, not token ids")
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt  # token ids are valid for /v1/completions
        return {**body, **self.extra_body}

    async def generate(self, request: BenchRequest) -> RequestResult:
        clock = TokenClock(time.perf_counter())
        chunks, usage_tokens, text = 0, None, []
        try:
            async with self.client.stream("POST", self.endpoint,
                                          json=self.payload(request)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    return failed(request, clock.start, f"HTTP {resp.status_code}: {body}")
                async for line in resp.aiter_lines():
                    data = sse_data(line)
                    if data is None:
                        continue
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        return failed(request, clock.start, json.dumps(chunk["error"]))
                    piece = chunk_text(chunk)
                    if piece is not None:
                        clock.chunk(time.perf_counter())
                        chunks += 1
                        text.append(piece)
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
        except Exception as e:  # connection refused, timeout, bad JSON: a failed request
            return failed(request, clock.start, e)
        if usage_tokens is None:
            self.counted_chunks = True
        return clock.result(request, usage_tokens if usage_tokens is not None else chunks,
                            "".join(text))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def vocab_size(self) -> int | None:
        return self._vocab

    def facts(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "served_model": self.model,
                "endpoint": self.endpoint,
                "token_count": "chunks (server sent no usage)" if self.counted_chunks
                else "usage.completion_tokens"}


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def chunk_text(chunk: dict[str, Any]) -> str | None:
    """New text in a streamed completion or chat chunk ("" for token ids without text); None
    if the chunk carries no token (a role-only first chat chunk, the usage chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    piece = choice.get("text")
    if piece is None:
        piece = (choice.get("delta") or {}).get("content")
    if piece:
        return piece
    # Tokens without text (a server with no tokenizer sends their ids): still a token arrival.
    return "" if choice.get("token_ids") else None
