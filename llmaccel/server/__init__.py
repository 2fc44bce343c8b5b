"""The OpenAI-compatible server: `build_app(AsyncLLM, ServerSettings) -> FastAPI`, run by
`llmaccel serve` (cli/serve.py). Needs the `server` extra (fastapi, uvicorn,
prometheus-client); importing this package alone does not, so the CLI starts without it."""

__all__ = ["ServerSettings", "build_app"]


def __getattr__(name: str):
    if name == "build_app":
        from llmaccel.server.app import build_app
        return build_app
    if name == "ServerSettings":
        from llmaccel.server.settings import ServerSettings
        return ServerSettings
    raise AttributeError(name)
