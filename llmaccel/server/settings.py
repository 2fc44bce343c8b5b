"""ServerSettings: what the HTTP layer needs beyond the engine (names, auth, limits)."""

from __future__ import annotations

from dataclasses import dataclass

from llmaccel.errors import LLMAccelError

# JSON of a full-context prompt as token ids is about 7 bytes a token: 16 MiB holds batches
# of long prompts and stops a client from making the server buffer gigabytes.
DEFAULT_MAX_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class ServerSettings:
    # Names clients may pass as `model`; the first is the default and the one /v1/models
    # lists first (vLLM's --served-model-name; by default the model path).
    served_model_names: tuple[str, ...] = ("default",)
    model_root: str | None = None        # the model path, reported as /v1/models `root`
    api_key: str | None = None           # Bearer token for /v1/* (None: no auth)
    # Admission control: requests admitted that have not produced a token yet. Past it a new
    # request gets 503 + Retry-After instead of queueing without bound. None: no limit.
    max_waiting: int | None = None
    retry_after_s: int = 1
    max_logprobs: int = 20               # vLLM's default cap on logprobs / top_logprobs
    chat_template: str | None = None     # overrides the tokenizer's template
    # On shutdown, in-flight requests get this long to finish before they are aborted.
    shutdown_timeout_s: float = 30.0
    # Browser origins allowed to call the API (CORS); empty: none, the browser's default.
    allowed_origins: tuple[str, ...] = ()
    # A request body is read no further than this (413 past it).
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # A connection must send a whole request head within this long of opening (or of its
    # last response), else it is closed.
    header_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not n for n in self.served_model_names):
            raise LLMAccelError("served model names must be non-empty")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise LLMAccelError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.api_key is not None and not self.api_key:
            raise LLMAccelError("the API key must not be empty")
        if self.shutdown_timeout_s < 0:
            raise LLMAccelError("shutdown_timeout_s must be >= 0")
        if self.header_timeout_s <= 0:
            raise LLMAccelError("header_timeout_s must be > 0")
        if self.max_request_body_bytes < 1:
            raise LLMAccelError("max_request_body_bytes must be >= 1")

    @property
    def default_model(self) -> str:
        return self.served_model_names[0]
