"""The FastAPI app over an AsyncLLM: routes, auth, response counting, lifespan."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmaccel.version import __version__
from llmaccel.engine.async_llm import AsyncLLM
from llmaccel.server.chat import create_chat_completion
from llmaccel.server.completions import create_completion
from llmaccel.server.errors import error_response, install_error_handlers
from llmaccel.server.limits import LimitBody
from llmaccel.server.metrics import CONTENT_TYPE
from llmaccel.server.protocol import ModelCard, ModelList
from llmaccel.server.settings import ServerSettings
from llmaccel.server.state import ServingState

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
          "/version")


PROTECTED_DOCS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class BearerAuth:
    """Requires `Authorization: Bearer <key>` on /v1/* and on the API's description (/docs,
    /redoc, /openapi.json); health and metrics stay open, as in vLLM. Compared in constant
    time, so response timing does not leak the key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1")
                                        or scope["path"] in PROTECTED_DOCS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key (expected "
                                          "'Authorization: Bearer <key>')",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CountResponses:
    """Counts responses by route and status for /metrics (unknown paths as 'other', so a
    scanner cannot grow the label set)."""

    def __init__(self, app: ASGIApp, state: ServingState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.state.metrics.on_response(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            # An unhandled error's 500 is sent by Starlette's outermost middleware, outside
            # this one: count it here.
            if not started:
                self.state.metrics.on_response(route, 500)
            raise


def public_root(model_root: str | None) -> str | None:
    """What /v1/models says the model is: a hub id or shape name as given, a local path by its
    last component only (the server's directory layout is no client's business)."""
    if model_root is None or not Path(model_root).expanduser().is_absolute() \
            and not Path(model_root).exists():
        return model_root
    return Path(model_root).name


def build_app(engine: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    state = ServingState(engine, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Normally drained already (serve()'s server drains before closing connections);
        # under a plain uvicorn this still aborts what is left and stops the engine loop.
        state.draining = True
        await engine.shutdown(abort_running=True)
        state.close()

    app = FastAPI(title="llmaccel", version=__version__, lifespan=lifespan)
    app.state.serving = state
    install_error_handlers(app)
    app.post("/v1/completions")(create_completion)
    app.post("/v1/chat/completions")(create_chat_completion)

    @app.get("/v1/models")
    async def models() -> Response:
        root = public_root(settings.model_root)
        cards = [ModelCard(id=name, root=root, max_model_len=state.max_model_len)
                 for name in settings.served_model_names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if state.draining else 200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.update_engine(await engine.get_stats())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # innermost first: the key is checked before a body is read, and every refusal counted
    app.add_middleware(LimitBody, max_bytes=settings.max_request_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    if settings.allowed_origins:  # outside the key check: a browser's preflight carries none
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(CountResponses, state=state)  # added last: outermost, sees the 401s
    return app
