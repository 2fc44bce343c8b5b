"""AsyncLLM: the engine for servers. Requests stream their outputs through async iterators
while one background task steps the engine (in a worker thread, so the event loop stays free
to accept requests while the model runs)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from llmaccel.engine.config import EngineConfig
from llmaccel.engine.llm_engine import LLMEngine
from llmaccel.engine.outputs import RequestOutput
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.engine.stats import EngineStats
from llmaccel.errors import LLMAccelError

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (a fault of the engine or the device, not
    of the request); the others went on. `cause` names the exception, which the engine
    logged."""

    def __init__(self, request_id: str, cause: str) -> None:
        super().__init__(f"the engine failed while running request {request_id}: {cause}")
        self.request_id, self.cause = request_id, cause


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._ids = itertools.count()
        self._lock = asyncio.Lock()          # engine calls never overlap a step
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._closed = False

    @classmethod
    def from_config(cls, model: str | None = None, **kwargs: Any) -> AsyncLLM:
        return cls(LLMEngine(EngineConfig(model=model, **kwargs)))

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None,
                       prompt_text: str | None = None,
                       coalesce: bool = False) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after every step that advanced it; the last
        one has finished=True. Leaving the loop early (a client gone) aborts the request.
        `coalesce`: a consumer that fell behind gets only the newest of the outputs waiting
        for it (they are cumulative, so nothing is lost): a server busy with many streams
        sends fewer, larger chunks instead of falling further behind (vLLM's AsyncLLM does
        the same). Off, every step's output is yielded (what exact per-token timing needs)."""
        request_id = request_id or f"req-{next(self._ids)}"
        queue = await self.add_request(request_id, prompt, params, prompt_text)
        finished = False
        try:
            while True:
                item = await queue.get()
                while coalesce and not queue.empty() and not isinstance(item, BaseException) \
                        and not item.finished:
                    item = queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams | None = None,
                          prompt_text: str | None = None) -> asyncio.Queue:
        """Queue a request (raises LLMAccelError for a bad one) and return its output queue."""
        if self._closed:  # no loop would ever step it
            raise LLMAccelError("the engine has been shut down")
        self._ensure_loop()
        async with self._lock:
            self.engine.add_request(request_id, prompt, params, prompt_text)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._wake.set()
        return queue

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or many (as vLLM's AsyncLLM.abort): many at once take the engine
        between two steps once, not once each."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        # Shielded: a cancelled caller (a client gone, whose cancellation frameworks deliver
        # again at every await) must not leave the request running while it waits for a step.
        await asyncio.shield(self._abort(ids))

    async def _abort(self, request_ids: list[str]) -> None:
        async with self._lock:
            outs = [(rid, self.engine.abort_request(rid)) for rid in request_ids]
        for rid, out in outs:
            queue = self._queues.get(rid)
            if out is not None and queue is not None:
                queue.put_nowait(out)

    async def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self._closed:
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                async with self._lock:
                    outputs = await asyncio.to_thread(self.engine.step)
            except Exception as e:  # noqa: BLE001 - the engine could not blame one request
                logger.error("an engine step failed; failing %d requests: %s: %s",
                             len(self._queues), type(e).__name__, e, exc_info=e)
                for request_id in list(self.engine.requests):
                    self.engine.abort_request(request_id)
                for queue in self._queues.values():
                    queue.put_nowait(e)
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out if out.error is None
                                     else RequestFailedError(out.request_id, out.error))
            await asyncio.sleep(0)  # let new requests and aborts in between steps

    async def shutdown(self, abort_running: bool = True) -> None:
        """Stop the loop; abort what is still running (it is reported as finished, 'abort')."""
        if abort_running:
            await self.abort(list(self.engine.requests))
        self._closed = True
        self._wake.set()
        if self._loop_task is not None:
            await self._loop_task
