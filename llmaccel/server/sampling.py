"""Request fields -> SamplingParams, and a clear 400 for OpenAI features this engine lacks
(rather than silently ignoring a penalty the client believes was applied)."""

from __future__ import annotations

import logging

from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.errors import LLMAccelError
from llmaccel.server.errors import bad_request
from llmaccel.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

logger = logging.getLogger(__name__)


_warned: set[str] = set()


def _warn_unknown(req: SamplingRequest) -> None:
    """Unknown fields are ignored (clients send many this server has no use for); each one is
    logged once, so a client relying on one can find out."""
    new = sorted(set(req.model_extra or {}) - _warned)
    if new:
        _warned.update(new)
        logger.warning("ignoring request fields this server does not know: %s", ", ".join(new))


def _unsupported(param: str, what: str) -> None:
    raise bad_request(f"{param}: {what} is not supported by this server", param)


def check_common(req: SamplingRequest) -> None:
    _warn_unknown(req)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            _unsupported(name, "a non-zero penalty")
    if req.repetition_penalty not in (None, 1, 1.0):
        _unsupported("repetition_penalty", "a repetition penalty")
    if req.logit_bias:
        _unsupported("logit_bias", "logit bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given when stream is true",
                          "stream_options")


def check_completion(req: CompletionRequest, max_logprobs: int) -> None:
    check_common(req)
    if req.echo:
        _unsupported("echo", "echoing the prompt")
    if req.suffix:
        _unsupported("suffix", "a suffix (insertion)")
    if req.best_of is not None and req.best_of != req.n:
        _unsupported("best_of", "best_of other than n")
    if req.logprobs is not None and req.logprobs > max_logprobs:
        raise bad_request(f"logprobs must be at most {max_logprobs}, got {req.logprobs}",
                          "logprobs")


def check_chat(req: ChatCompletionRequest, max_logprobs: int) -> None:
    check_common(req)
    if req.tools:
        _unsupported("tools", "tool calling")
    if req.tool_choice not in (None, "none", "auto"):
        _unsupported("tool_choice", "a tool choice")
    if req.response_format is not None and req.response_format.get("type") != "text":
        _unsupported("response_format", "a structured response format")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        if req.top_logprobs > max_logprobs:
            raise bad_request(f"top_logprobs must be at most {max_logprobs}, got "
                              f"{req.top_logprobs}", "top_logprobs")
    if (req.max_tokens is not None and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens):
        raise bad_request("max_tokens and max_completion_tokens differ; give one",
                          "max_completion_tokens")


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def chat_top_logprobs(req: ChatCompletionRequest) -> int | None:
    """SamplingParams.logprobs for chat: None (off) or the number of alternatives."""
    return (req.top_logprobs or 0) if req.logprobs else None


def to_sampling_params(req: SamplingRequest, max_tokens: int | None,
                       logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k, min_p=req.min_p, seed=req.seed,
            stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            output_kind="cumulative")  # every step: streaming, TTFT/ITL, admission
    except LLMAccelError as e:
        raise bad_request(str(e)) from None


def check_stop_token_ids(req: SamplingRequest, vocab_size: int) -> None:
    # An id outside the vocabulary would index past the logits row in the sampler.
    bad = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids outside the vocabulary (0..{vocab_size - 1}): "
                          f"{bad[:5]}", "stop_token_ids")
