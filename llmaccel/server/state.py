"""ServingState: what every route shares (engine, settings, metrics) and the request
accounting behind admission control and graceful shutdown."""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from llmaccel.engine.async_llm import AsyncLLM
from llmaccel.server.choices import TokenNames
from llmaccel.server.errors import APIError
from llmaccel.server.limits import check_prompt_chars, longest_token_chars
from llmaccel.server.metrics import ServerMetrics
from llmaccel.server.settings import ServerSettings

logger = logging.getLogger(__name__)
T = TypeVar("T")
LARGE_TEXT_CHARS = 16384  # a text past this many characters is tokenized in the large lane


class Reservation:
    """Admission slots taken by one HTTP request, one per engine request it will start. A slot
    is given back when its engine request produces its first output (it is no longer
    waiting) or fails; whatever is left goes back when the HTTP request ends."""

    def __init__(self, state: ServingState, slots: int) -> None:
        self.state, self.left = state, slots

    def release(self, slots: int = 1) -> None:
        slots = min(slots, self.left)
        self.left -= slots
        self.state.waiting -= slots

    def release_all(self) -> None:
        self.release(self.left)


class ServingState:
    def __init__(self, engine: AsyncLLM, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        core = engine.engine
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.vocab_size: int = core.model_config.hf_config.vocab_size
        self.token_names = TokenNames(self.tokenizer)
        # the most characters one token covers: a longer text than max_model_len of them is
        # refused before tokenizing (0: no tokenizer, no bound)
        self.longest_token = longest_token_chars(self.tokenizer) if self.tokenizer else 0
        self.metrics = ServerMetrics(settings.default_model, speculative=core.spec is not None)
        self.waiting = 0       # engine requests admitted that have no output yet
        self.in_flight = 0     # generation requests between admission and their last byte
        self.draining = False  # shutting down: no new generation requests
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        # Tokenization and chat templates run off the event loop in two lanes, one thread and
        # one tokenizer each (a fast tokenizer must not encode in two threads at once): texts
        # over LARGE_TEXT_CHARS queue in their own lane, so a huge prompt never holds up the
        # short ones behind it.
        self._lanes = (ThreadPoolExecutor(1, thread_name_prefix="llmaccel-tokenize"),
                       ThreadPoolExecutor(1, thread_name_prefix="llmaccel-tokenize-large"))
        self._tokenizers = (self.tokenizer, copy.deepcopy(self.tokenizer))

    # -- names -------------------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> str:
        if name is None:
            return self.settings.default_model
        if name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return name

    def new_id(self, prefix: str) -> str:
        """A response id as vLLM's ('cmpl-...', 'chatcmpl-...'): unique across restarts."""
        return f"{prefix}-{uuid.uuid4().hex}"

    def engine_request_id(self, response_id: str, index: int) -> str:
        # the counter keeps engine ids unique even if a client-visible id ever repeated
        return f"{response_id}-{index}-{next(self._ids)}"

    # -- admission ---------------------------------------------------------------------------
    def admit(self, slots: int) -> Reservation:
        """Take `slots` waiting places (one per prompt; a prompt's n completions are one engine
        request) or refuse: 503 while draining or while the queue is full, 400 for more prompts
        than the queue holds at all."""
        if self.draining:
            raise APIError(503, "the server is shutting down",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        limit = self.settings.max_waiting
        if limit is not None and slots > limit:  # would wait for a queue it can never fit
            raise APIError(400, f"this request has {slots} prompts and at most {limit} may "
                           "wait at once (--max-waiting): send fewer prompts per request",
                           "prompt")
        if limit is not None and self.waiting + slots > limit:
            raise APIError(503, f"too many requests waiting ({self.waiting} of at most "
                           f"{limit}); retry later",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        self.waiting += slots
        return Reservation(self, slots)

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def check_chars(self, text: str, param: str) -> None:
        check_prompt_chars(text, self.max_model_len, self.longest_token, param)

    async def tokenize(self, chars: int, fn: Callable[[Any], T]) -> T:
        """fn(tokenizer) in the tokenizer lane for a text of `chars` characters."""
        lane = int(chars > LARGE_TEXT_CHARS)
        return await asyncio.get_running_loop().run_in_executor(
            self._lanes[lane], fn, self._tokenizers[lane])

    # -- shutdown ----------------------------------------------------------------------------
    async def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new requests, give in-flight ones `timeout_s` to finish, abort the rest
        (their streams end with finish_reason "abort"), and stop the engine loop."""
        self.draining = True
        timeout_s = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        if self.in_flight:
            logger.info("waiting up to %.0fs for %d requests", timeout_s, self.in_flight)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                logger.warning("aborting %d requests still running", self.in_flight)
        await self.engine.shutdown(abort_running=True)
        try:  # the aborted ones write their last chunk and end
            await asyncio.wait_for(self._idle.wait(), 10.0)
        except asyncio.TimeoutError:
            logger.warning("%d responses did not end after their requests were aborted",
                           self.in_flight)

    def close(self) -> None:
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)
