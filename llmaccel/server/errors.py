"""Errors as OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}, with vLLM's
type names (BadRequestError, NotFoundError, ...) and the HTTP status as `code`."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmaccel.errors import LLMAccelError
from llmaccel.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestTooLargeError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """A request the server answers with an error status (raised anywhere in a handler)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# A 5xx body never carries exception text (it may hold paths, prompts or internals).
INTERNAL_ERROR = "internal server error (the server log has the details)"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param,
                                         code=status)).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem, named by its field ('max_tokens: Input should be ...'); malformed
    JSON said as such."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', '')}".rstrip(": "), None
    if not loc:  # the body itself: not an object, or missing
        return f"the request body must be a JSON object: {first.get('msg', '')}", None
    # A union (stop: str | list[str]) fails once per member: say each way it failed once.
    same = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    msgs = list(dict.fromkeys(str(e.get("msg", "invalid value")).removeprefix("Value error, ")
                              for e in same))
    where = loc[0] if len(same) > 1 else ".".join(loc)
    return f"{where}: {'; or '.join(msgs)}", loc[0]


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    async def on_engine_error(_: Request, exc: LLMAccelError) -> JSONResponse:
        # The engine rejects a request it cannot run (empty prompt, ids outside the
        # vocabulary, too long) with LLMAccelError: the client's fault.
        return error_response(400, str(exc))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug or a failed engine step: still OpenAI's shape, without the exception's text
        # (it may hold paths or data of other requests); the server log has the traceback.
        return error_response(500, INTERNAL_ERROR)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(LLMAccelError, on_engine_error)
    app.add_exception_handler(StarletteHTTPException, on_http)
