"""Request and response bodies of the OpenAI API, with vLLM's extensions and shapes.

Requests are strict (a string where a number belongs is a 400, not silently converted) and
ignore unknown fields, as OpenAI clients send fields this server has no use for. Responses
keep OpenAI's nulls (`finish_reason: null`), except where OpenAI leaves a key out (a chat
delta carries only what changed).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

INT64_MAX = 2**63 - 1


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class SamplingRequest(RequestModel):
    """Fields both endpoints share: OpenAI's, then vLLM's sampling extensions."""
    model: str | None = None  # None: the first served name (vLLM allows leaving it out)
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=INT64_MAX - 128)  # seed + i for the i-th choice
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's; refused unless 1 (no penalty)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # token ids of prompt and choices in the response

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, value: str | list[str] | None) -> str | list[str] | None:
        # every stop string is searched for in every new piece of text of every choice: a
        # request must not be able to slow the others down with a million of them
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        long = [len(s) for s in stops if len(s) > MAX_STOP_CHARS]
        if long:
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got "
                             f"{long[0]}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_bounded(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(value)}")
        return value


class CompletionRequest(SamplingRequest):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked below
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        def ids(v: Any) -> bool:
            return isinstance(v, list) and all(type(t) is int for t in v)

        if isinstance(value, str) or ids(value):
            return value
        if isinstance(value, list) and value and (
                all(isinstance(p, str) for p in value) or all(ids(p) for p in value)):
            return value
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or "
                         "a list of lists of token ids")


class ContentPart(RequestModel):
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context length
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for it
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM extension


# -- responses ---------------------------------------------------------------------------------
def now_s() -> int:
    return int(time.time())


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Keys left out when None (OpenAI omits them; other None fields are sent as null).
    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler: Any) -> Any:
        data = handler(self)
        for key in self.omit_if_none:
            if key in data and data[key] is None:
                del data[key]
        return data


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(ResponseModel):
    omit_if_none = frozenset({"prompt_tokens_details"})
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    omit_if_none = frozenset({"token_ids", "prompt_token_ids"})
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(ResponseModel):
    omit_if_none = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(TopLogProb):
    top_logprobs: list[TopLogProb] = Field(default_factory=list)


class ChatLogProbs(ResponseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatMessageOut(ResponseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(ResponseModel):
    omit_if_none = frozenset({"token_ids"})
    index: int
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(ResponseModel):
    omit_if_none = frozenset({"prompt_token_ids"})
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(ResponseModel):
    omit_if_none = frozenset({"role", "content"})
    # A delta names only what changed: the role once, then content.
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(ResponseModel):
    omit_if_none = frozenset({"token_ids"})
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(ResponseModel):
    omit_if_none = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "llmaccel"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
