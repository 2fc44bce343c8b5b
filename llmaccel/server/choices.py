"""Engine outputs -> what a choice sends: stream increments (with stop-string hold-back), token
logprobs in both APIs' shapes, usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmaccel.engine.outputs import CompletionOutput, RequestOutput
from llmaccel.server.protocol import (ChatLogProbs, ChatLogProbsContent, CompletionLogProbs,
                                      PromptTokensDetails, TopLogProb, UsageInfo)

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


@dataclass
class Delta:
    text: str
    start: int               # index of the first new token in the choice's token ids
    token_ids: list[int]     # the new tokens
    finish_reason: str | None
    stop_reason: int | str | None


class ChoiceCursor:
    """How much of one choice a stream has sent.

    The engine cuts a stop string out of the text only once it is complete, so text that
    might be the start of one is held back while the choice runs (len(longest stop) - 1
    characters): streamed text is never taken back."""

    def __init__(self, stop: list[str] | None) -> None:
        self.hold = max((len(s) for s in stop or []), default=1) - 1
        self.chars = 0
        self.tokens = 0
        self.text_offset = 0     # completions logprobs: where the next token's text starts
        self.finished = False

    def advance(self, c: CompletionOutput, want_tokens: bool) -> Delta | None:
        """The increment since the last call, or None if there is nothing worth a chunk.
        `want_tokens`: new tokens are worth a chunk without text (logprobs, token ids)."""
        if self.finished:
            return None
        end = len(c.text) if c.finished else len(c.text) - self.hold
        end = max(end, self.chars)
        text = c.text[self.chars:end]
        new_ids = c.token_ids[self.tokens:]
        if not (text or c.finished or (want_tokens and new_ids)):
            return None
        delta = Delta(text, self.tokens, list(new_ids), c.finish_reason, c.stop_reason)
        self.chars, self.tokens, self.finished = end, len(c.token_ids), c.finished
        return delta


class TokenNames:
    """Token id -> its text, as logprobs name tokens (cached: the same ids recur)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._cache.get(token_id)
        if name is None:
            name = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = name
        return name


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def completion_logprobs(names: TokenNames, token_ids: list[int],
                        logprobs: list[dict[int, float]], cursor: ChoiceCursor | None = None
                        ) -> CompletionLogProbs:
    """Completions' shape: per token its text, logprob, top alternatives and text offset.
    `logprobs[i]` holds token i's own logprob and the top-k (the engine's layout)."""
    out = CompletionLogProbs()
    offset = cursor.text_offset if cursor is not None else 0
    for tid, top in zip(token_ids, logprobs):
        name = names(tid)
        out.tokens.append(name)
        out.token_logprobs.append(_lp(top[tid]) if tid in top else None)
        out.top_logprobs.append({names(t): _lp(v) for t, v in top.items()})
        out.text_offset.append(offset)
        offset += len(name)
    if cursor is not None:
        cursor.text_offset = offset
    return out


def chat_logprobs(names: TokenNames, token_ids: list[int], logprobs: list[dict[int, float]],
                  k: int) -> ChatLogProbs:
    """Chat's shape: per token its text, bytes, logprob and the k most likely tokens."""
    content = []
    for tid, top in zip(token_ids, logprobs):
        name = names(tid)
        # the sampled token comes first in the engine's dict: sort to get the top k
        best = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:k]
        content.append(ChatLogProbsContent(
            token=name, logprob=_lp(top.get(tid, MIN_LOGPROB)), bytes=list(name.encode()),
            top_logprobs=[TopLogProb(token=names(t), logprob=_lp(v),
                                     bytes=list(names(t).encode())) for t, v in best]))
    return ChatLogProbs(content=content)


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
