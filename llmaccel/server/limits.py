"""Bounds on what a client can make the server hold: the request body is read no further than
`--max-request-body-bytes` before any route sees it (413 in OpenAI's error shape past it), and
a prompt whose characters alone prove it too long for the context is refused before it is
tokenized."""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmaccel.server.errors import bad_request, error_response


class LimitBody:
    """Reads each request's body up to `max_bytes` (refusing a larger Content-Length at once,
    unread), then hands the buffered body to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"request body larger than {self.max_bytes:,} bytes "
                                  "(the server's --max-request-body-bytes)",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending it all
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks),
                                   "more_body": False}]

        async def replay() -> Message:
            # the body once, then the real channel (a streaming route watches it for the
            # client's disconnect)
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` can cover (its longest vocabulary entry;
    byte-level entries have one character per byte, so no more decoded characters)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no character bound
        return 0
    return max((len(t) for t in vocab), default=0)


def check_prompt_chars(text: str, max_model_len: int, longest: int, param: str) -> None:
    """A text of more than max_model_len x `longest` characters has more than max_model_len
    tokens, whatever the tokenizer makes of it: refuse it without tokenizing."""
    if longest > 0 and len(text) > max_model_len * longest:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; "
                          f"the {param} has {len(text):,} characters, more than that many "
                          "tokens can hold. Please reduce the length of the input.", param)
