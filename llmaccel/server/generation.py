"""Engine requests as the HTTP layer runs them: started (the engine's verdict known before any
response byte), timed for /metrics, merged when one HTTP request holds several, and aborted
whenever their consumer goes away, however it goes (a disconnect cancels the handler; anyio
delivers that cancellation again at every await, hence the shielded aborts)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

import anyio
from starlette.requests import Request

from llmaccel.engine.async_llm import RequestFailedError
from llmaccel.engine.outputs import RequestOutput
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.errors import LLMAccelError
from llmaccel.server.metrics import RequestTimer
from llmaccel.server.state import Reservation, ServingState

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class EngineStream:
    """One engine request's cumulative outputs; `aclose()` aborts it if it has not finished."""

    def __init__(self, state: ServingState, request_id: str, gen: AsyncIterator[RequestOutput],
                 first: RequestOutput, timer: RequestTimer) -> None:
        self.state, self.request_id = state, request_id
        self._gen, self.timer = gen, timer
        self._pending: RequestOutput | None = first  # received, not yet handed out
        self.last = first
        self.finished = False  # the engine is done with it (or it was aborted here)
        self._record(first)

    @classmethod
    async def start(cls, state: ServingState, request_id: str, prompt: list[int],
                    params: SamplingParams, reservation: Reservation) -> EngineStream:
        """Queue the request and wait for its first output. The engine's LLMAccelError (a
        request it cannot run) is raised here, so it becomes a 400 rather than a broken
        stream."""
        timer = RequestTimer()
        gen = state.engine.generate(prompt, params, request_id=request_id, coalesce=True)
        try:
            first = await gen.__anext__()
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await gen.aclose()
                await state.engine.abort(request_id)
            if isinstance(e, RequestFailedError):
                state.metrics.on_finish(timer, "error")
            elif not isinstance(e, LLMAccelError):  # accepted, then gone before its first token
                state.metrics.on_finish(timer, "abort")
            raise
        finally:
            reservation.release()
        return cls(state, request_id, gen, first, timer)

    def _record(self, out: RequestOutput) -> None:
        self.last = out
        self.state.metrics.on_output(self.timer, out)  # timed on arrival, not on use
        self.finished = out.finished

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._gen.__anext__()
        except RequestFailedError:
            self.finished = True  # the engine has let it go already: nothing to abort
            self.state.metrics.on_finish(self.timer, "error")
            raise
        self._record(out)
        return out

    async def aclose(self) -> None:
        if self.finished:
            return
        self.finished = True
        with anyio.CancelScope(shield=True):
            await self._gen.aclose()  # AsyncLLM.generate drops its queue and aborts
            await self.state.engine.abort(self.request_id)  # in case that abort was cancelled
        self.state.metrics.on_finish(self.timer, "abort")


async def start_streams(state: ServingState, request_ids: list[str], prompts: list[list[int]],
                        params: SamplingParams, reservation: Reservation) -> list[EngineStream]:
    """Start every prompt's request; if any is refused (or this is cancelled), abort the ones
    already started and raise."""
    if len(prompts) == 1:
        return [await EngineStream.start(state, request_ids[0], prompts[0], params,
                                         reservation)]
    started: dict[int, EngineStream] = {}

    async def one(i: int) -> None:
        started[i] = await EngineStream.start(state, request_ids[i], prompts[i], params,
                                              reservation)

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            await close_streams(list(started.values()))
        raise
    return [started[i] for i in range(len(prompts))]


async def close_streams(streams: list[EngineStream]) -> None:
    with anyio.CancelScope(shield=True):
        for s in streams:
            await s.aclose()


async def merge(streams: list[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams as they arrive, until all have finished."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: EngineStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):  # the pumps stop before anyone closes a stream
            await asyncio.gather(*tasks, return_exceptions=True)


async def collect(streams: list[EngineStream]) -> list[RequestOutput]:
    """Run every stream to its end; the final output of each."""
    async with aclosing(merge(streams)) as outputs:
        async for _ in outputs:
            pass
    return [s.last for s in streams]


async def wait_for_disconnect(request: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` but cancel it (its cleanup aborts its requests) if the client goes away
    first; raises ClientGone then. Starlette only does this for streaming bodies."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
