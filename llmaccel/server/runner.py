"""uvicorn, stopping gracefully: on SIGINT/SIGTERM (or should_exit) it stops accepting
connections, lets in-flight requests finish for up to the drain timeout, aborts the rest (their
streams end with finish_reason "abort" and [DONE]), and only then closes connections."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmaccel.server.state import ServingState


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServingState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn would close connections first and then wait for tasks; draining first
        # lets streams end with a final chunk instead of a cut connection.
        for server in getattr(self, "servers", []):
            server.close()  # no new connections while draining
        await self.state.drain()
        await super().shutdown(sockets=sockets)


def header_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline on request headers: a connection that has not
    sent a whole request head within `seconds` of opening (or of its last response) is
    closed. uvicorn has none, so idle or half-sent connections held sockets forever."""

    class HeaderTimeoutH11(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self._busy():
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(seconds, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self._busy() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info", configure_logging: bool = True) -> DrainingServer:
    state: ServingState = app.state.serving
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        http=header_timeout_protocol(state.settings.header_timeout_s),
        # after our drain, connections only need to write their last bytes
        timeout_graceful_shutdown=5,
        **({} if configure_logging else {"log_config": None}))
    return DrainingServer(config, state)
