"""POST /v1/completions: prompts (text or token ids, one or a batch) -> text_completion
responses or chunks. Choice i * n + j is completion j of prompt i, as in vLLM."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import Response

from llmaccel.engine.outputs import CompletionOutput, RequestOutput
from llmaccel.server.choices import ChoiceCursor, completion_logprobs, usage
from llmaccel.server.errors import bad_request
from llmaccel.server.generation import EngineStream, merge
from llmaccel.server.prompts import check_context, completion_prompts
from llmaccel.server.protocol import (CompletionChoice, CompletionRequest, CompletionResponse,
                                      CompletionStreamResponse, now_s)
from llmaccel.server.sampling import check_completion, check_stop_token_ids, to_sampling_params
from llmaccel.server.serving import SSE_DONE, Generation, run_generation, sse, sse_error
from llmaccel.server.state import ServingState


async def create_completion(req: CompletionRequest, request: Request) -> Response:
    state: ServingState = request.app.state.serving
    model = state.resolve_model(req.model)
    check_completion(req, state.settings.max_logprobs)
    check_stop_token_ids(req, state.vocab_size)
    if req.stop and state.tokenizer is None:
        raise bad_request("stop strings need a tokenizer, which this model has none of: use "
                          "stop_token_ids", "stop")
    chars = 0
    for text in [req.prompt] if isinstance(req.prompt, str) else req.prompt:
        if isinstance(text, str):
            state.check_chars(text, "prompt")
            chars += len(text)
    prompts = await state.tokenize(chars, lambda tok: completion_prompts(req.prompt, tok))
    for p in prompts:
        check_context(len(p), req.max_tokens, state.max_model_len, "prompt")
    params = to_sampling_params(req, req.max_tokens, req.logprobs)
    response_id = state.new_id("cmpl")
    created = now_s()
    names = state.token_names
    # Without a tokenizer (a benchmark shape, --skip-tokenizer-init) the text is empty, so the
    # token ids are the output: every choice carries them and every step is worth a chunk.
    with_ids = req.return_token_ids or state.tokenizer is None

    def choice(i: int, out: RequestOutput, c: CompletionOutput, text: str, ids: list[int],
               start: int, cursor: ChoiceCursor | None) -> CompletionChoice:
        return CompletionChoice(
            index=i * req.n + c.index, text=text, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=None if req.logprobs is None else completion_logprobs(
                names, ids, (c.logprobs or [])[start:start + len(ids)], cursor),
            token_ids=ids if with_ids else None,
            prompt_token_ids=out.prompt_token_ids if with_ids and start == 0
            else None)

    def render(finals: list[RequestOutput]) -> CompletionResponse:
        choices = [choice(i, out, c, c.text, c.token_ids, 0, None)
                   for i, out in enumerate(finals) for c in out.outputs]
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(id=response_id, created=created, model=model,
                                  choices=choices, usage=usage(finals))

    async def events(streams: list[EngineStream]) -> AsyncIterator[str]:
        cursors = [[ChoiceCursor(params.stop) for _ in range(req.n)] for _ in streams]
        want_tokens = req.logprobs is not None or with_ids
        options = req.stream_options
        try:
            async with aclosing(merge(streams)) as outputs:
                async for i, out in outputs:
                    for c in out.outputs:
                        cursor = cursors[i][c.index]
                        d = cursor.advance(c, want_tokens)
                        if d is None:
                            continue
                        chunk = CompletionStreamResponse(
                            id=response_id, created=created, model=model,
                            choices=[choice(i, out, c, d.text, d.token_ids, d.start, cursor)])
                        if options and options.continuous_usage_stats:
                            chunk.usage = usage([s.last for s in streams])
                        yield sse(chunk)
            if options and options.include_usage:
                yield sse(CompletionStreamResponse(id=response_id, created=created, model=model,
                                                   choices=[],
                                                   usage=usage([s.last for s in streams])))
        except Exception as e:  # noqa: BLE001 - the client learns of it in the stream
            yield sse_error(e)
        yield SSE_DONE

    return await run_generation(state, request, Generation(
        response_id, prompts, params, req.stream, render, events))
