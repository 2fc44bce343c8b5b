"""uvicorn, stopping gracefully: on SIGINT/SIGTERM (or should_exit) it stops accepting
connections, lets in-flight requests finish for up to the drain timeout, aborts the rest (their
streams end with finish_reason "abort" and [DONE]), and only then closes connections."""

from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI

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


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info", configure_logging: bool = True) -> DrainingServer:
    state: ServingState = app.state.serving
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        # after our drain, connections only need to write their last bytes
        timeout_graceful_shutdown=5,
        **({} if configure_logging else {"log_config": None}))
    return DrainingServer(config, state)
