"""POST /v1/chat/completions: messages through the chat template -> chat.completion responses
or chat.completion.chunk events (each choice's role first, then content deltas)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import Response

from llmaccel.engine.outputs import CompletionOutput, RequestOutput
from llmaccel.server.choices import ChoiceCursor, chat_logprobs, usage
from llmaccel.server.generation import EngineStream, merge
from llmaccel.server.prompts import chat_prompt, check_context, message_dicts
from llmaccel.server.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                      ChatCompletionStreamResponse, ChatLogProbs, ChatMessageOut,
                                      ChatStreamChoice, DeltaMessage, now_s)
from llmaccel.server.sampling import (chat_max_tokens, chat_top_logprobs, check_chat,
                                      check_stop_token_ids, to_sampling_params)
from llmaccel.server.serving import SSE_DONE, Generation, run_generation, sse, sse_error
from llmaccel.server.state import ServingState

ROLE = "assistant"


async def create_chat_completion(req: ChatCompletionRequest, request: Request) -> Response:
    state: ServingState = request.app.state.serving
    model = state.resolve_model(req.model)
    check_chat(req, state.settings.max_logprobs)
    check_stop_token_ids(req, state.vocab_size)
    messages = message_dicts(req.messages)
    chars = sum(len(m["content"]) for m in messages)
    state.check_chars("".join(m["content"] for m in messages), "messages")
    prompt = await state.tokenize(chars, lambda tok: chat_prompt(
        messages, tok, state.settings.chat_template, req.add_generation_prompt))
    max_tokens = chat_max_tokens(req)
    check_context(len(prompt), max_tokens, state.max_model_len, "messages")
    k = chat_top_logprobs(req)
    params = to_sampling_params(req, max_tokens, k)
    response_id = state.new_id("chatcmpl")
    created = now_s()
    names = state.token_names

    def logprobs(c: CompletionOutput, ids: list[int], start: int) -> ChatLogProbs | None:
        if k is None:
            return None
        return chat_logprobs(names, ids, (c.logprobs or [])[start:start + len(ids)], k)

    def render(finals: list[RequestOutput]) -> ChatCompletionResponse:
        out = finals[0]
        choices = [ChatChoice(index=c.index, message=ChatMessageOut(role=ROLE, content=c.text),
                              logprobs=logprobs(c, c.token_ids, 0),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                              token_ids=c.token_ids if req.return_token_ids else None)
                   for c in out.outputs]
        return ChatCompletionResponse(
            id=response_id, created=created, model=model, choices=choices, usage=usage(finals),
            prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None)

    def chunk(choices: list[ChatStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=response_id, created=created, model=model,
                                            choices=choices)

    async def events(streams: list[EngineStream]) -> AsyncIterator[str]:
        cursors = [ChoiceCursor(params.stop) for _ in range(req.n)]
        want_tokens = k is not None or req.return_token_ids
        options = req.stream_options
        try:
            for i in range(req.n):  # OpenAI's first chunk of a choice names the role
                yield sse(chunk([ChatStreamChoice(index=i,
                                                  delta=DeltaMessage(role=ROLE, content=""))]))
            async with aclosing(merge(streams)) as outputs:
                async for _, out in outputs:
                    for c in out.outputs:
                        d = cursors[c.index].advance(c, want_tokens)
                        if d is None:
                            continue
                        event = chunk([ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(content=d.text),
                            logprobs=logprobs(c, d.token_ids, d.start),
                            finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                            token_ids=d.token_ids if req.return_token_ids else None)])
                        if options and options.continuous_usage_stats:
                            event.usage = usage([s.last for s in streams])
                        yield sse(event)
            if options and options.include_usage:
                final = chunk([])
                final.usage = usage([s.last for s in streams])
                yield sse(final)
        except Exception as e:  # noqa: BLE001 - the client learns of it in the stream
            yield sse_error(e)
        yield SSE_DONE

    return await run_generation(state, request, Generation(
        response_id, [prompt], params, req.stream, render, events))
