"""What both generation endpoints do around the engine: admission, starting the requests,
a JSON body or an SSE stream, and cleanup that runs however the response ends."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from llmaccel.engine.async_llm import RequestFailedError
from llmaccel.engine.outputs import RequestOutput
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.errors import LLMAccelError
from llmaccel.server.errors import INTERNAL_ERROR, error_body
from llmaccel.server.generation import (ClientGone, EngineStream, close_streams, collect,
                                        start_streams, unless_disconnected)
from llmaccel.server.state import ServingState

logger = logging.getLogger(__name__)

# nginx's "client closed request": counted in /metrics, never seen by the (gone) client
CLIENT_CLOSED = 499


@dataclass
class Generation:
    """One HTTP request's work: its prompts, params, and how to render the outcome."""
    response_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    render: Callable[[list[RequestOutput]], BaseModel]             # final outputs -> body
    events: Callable[[list[EngineStream]], AsyncIterator[str]]     # streams -> SSE events


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: Exception) -> str:
    """An error after the stream began: an error event (vLLM's way), then [DONE]."""
    if isinstance(exc, LLMAccelError):
        return f"data: {json.dumps(error_body(400, str(exc) or type(exc).__name__))}\n\n"
    if not isinstance(exc, RequestFailedError):  # the engine logged that one already
        logger.error("request failed mid-stream: %s", exc, exc_info=exc)
    return f"data: {json.dumps(error_body(500, INTERNAL_ERROR))}\n\n"


class EngineStreamingResponse(StreamingResponse):
    """An SSE response whose cleanup (abort unfinished requests, account the request) runs
    however it ends: finished, client gone, or cancelled before its body ever started."""

    def __init__(self, content: AsyncIterator[str],
                 cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


async def run_generation(state: ServingState, request: Request, gen: Generation) -> Response:
    reservation = state.admit(len(gen.prompts))
    state.begin()
    handed_off = False  # a streaming response ends the request itself
    try:
        ids = [state.engine_request_id(gen.response_id, i) for i in range(len(gen.prompts))]
        streams = await unless_disconnected(
            request, start_streams(state, ids, gen.prompts, gen.params, reservation))
        if gen.stream:
            body = gen.events(streams)

            async def cleanup() -> None:
                await body.aclose()  # type: ignore[attr-defined]
                await close_streams(streams)
                state.end()

            handed_off = True
            return EngineStreamingResponse(body, cleanup)
        try:
            finals = await unless_disconnected(request, collect(streams))
        finally:
            await close_streams(streams)  # nothing left to abort when all finished
        return Response(gen.render(finals).model_dump_json(), media_type="application/json")
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        reservation.release_all()
        if not handed_off:
            state.end()
