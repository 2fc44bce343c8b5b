"""The OpenAI-compatible server (llmaccel/server) on a real uvicorn over a tiny random model
(CPU): completions and chat, streamed and not, against LLM.generate / LLM.chat; the openai
client; bad inputs; concurrency; disconnects; admission control; auth; /metrics; shutdown;
the `serve` command."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
import sys
from pathlib import Path

import httpx
import openai
import pytest

from llmaccel import LLM, SamplingParams
from llmaccel.engine.async_llm import AsyncLLM
from llmaccel.server.settings import ServerSettings
from server_harness import (ServerThread, engine_kwargs, get_metrics, make_model_dir, metric,
                            raw_post, read_response, read_until, sse_events, wait_until)

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PROMPTS = ["w1 w2 w3", "w10 " * 20, "w7", "w3 w4 w5 w6 w7 w8 w9 w10 w11",
           "w50 w51 " * 12, "w99 w98"]
CHATS = [[{"role": "user", "content": "w1 w2 w3"}],
         [{"role": "system", "content": "w5"}, {"role": "user", "content": "w6 w7"},
          {"role": "assistant", "content": "w8"}, {"role": "user", "content": "w9"}]]
LONG = 200  # tokens a request would need to finish: far more than any test waits for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny-words"))


@pytest.fixture(scope="module")
def server(model_dir):
    engine = AsyncLLM.from_config(str(model_dir), **engine_kwargs())
    srv = ServerThread(engine, ServerSettings(served_model_names=("tiny", "tiny-alias"),
                                              model_root=str(model_dir))).start()
    yield srv
    srv.stop()
    assert srv.used_blocks == 0


@pytest.fixture(scope="module")
def reference(model_dir):
    """LLM.generate / LLM.chat on the same weights: what greedy server outputs must equal."""
    llm = LLM(str(model_dir), **engine_kwargs())
    gen = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    chat = [llm.chat(conv, GREEDY, use_tqdm=False)[0] for conv in CHATS]
    return gen, chat


def check_shape(body: dict, prefix: str, obj: str) -> None:
    assert body["id"].startswith(prefix + "-") and body["object"] == obj
    assert isinstance(body["created"], int) and body["model"] in ("tiny", "tiny-alias")


async def post(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, dict]:
    r = await client.post(path, json=body)
    return r.status_code, r.json()


async def stream(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, list]:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, [r.json()]
        return 200, sse_events([line async for line in r.aiter_lines()])


def joined(events: list, key: str = "text") -> tuple[str, list[int], str | None]:
    """Streamed text, token ids and finish reason of choice 0."""
    text, ids, finish = "", [], None
    for e in events:
        if e == "[DONE]" or not e["choices"]:
            continue
        choice = e["choices"][0]
        text += choice[key] if key == "text" else choice["delta"].get("content", "")
        ids += choice.get("token_ids") or []
        finish = choice["finish_reason"] or finish
    return text, ids, finish


def run(coro):
    return asyncio.run(coro)


# -- outputs -----------------------------------------------------------------------------------
def test_greedy_completions_match_llm_generate(server, reference):
    """All prompts at once, half streamed: same text and token ids as LLM.generate."""
    gen, _ = reference
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            plain = [post(c, "/v1/completions", {**body, "prompt": p}) for p in PROMPTS]
            streamed = [stream(c, "/v1/completions", {**body, "prompt": p, "stream_options":
                                                      {"include_usage": True}})
                        for p in PROMPTS]
            return await asyncio.gather(*plain), await asyncio.gather(*streamed)

    plain, streamed = run(go())
    for ref, (status, res), (s_status, events) in zip(gen, plain, streamed):
        assert status == 200 and s_status == 200
        check_shape(res, "cmpl", "text_completion")
        choice = res["choices"][0]
        out = ref.outputs[0]
        assert choice["index"] == 0 and choice["text"] == out.text
        assert choice["token_ids"] == out.token_ids
        assert choice["prompt_token_ids"] == ref.prompt_token_ids
        assert choice["finish_reason"] == out.finish_reason and choice["logprobs"] is None
        n_out = len(out.token_ids)
        assert res["usage"] == {"prompt_tokens": len(ref.prompt_token_ids),
                                "completion_tokens": n_out,
                                "total_tokens": len(ref.prompt_token_ids) + n_out,
                                "prompt_tokens_details": res["usage"]["prompt_tokens_details"]}
        assert events[-1] == "[DONE]"
        assert all(e["id"] == events[0]["id"] for e in events[:-1])
        check_shape(events[0], "cmpl", "text_completion")
        assert (out.text, out.token_ids, out.finish_reason) == joined(events)
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == n_out


def test_batch_prompt_and_n(server, reference):
    """A list of prompts with n=2: choice i*n+j is completion j of prompt i."""
    gen, _ = reference
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPTS[:3], "n": 2, "max_tokens": MAX_TOKENS,
        "temperature": 0})
    assert r.status_code == 200
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for i, ref in enumerate(gen[:3]):
        assert choices[2 * i]["text"] == choices[2 * i + 1]["text"] == ref.outputs[0].text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == sum(len(g.prompt_token_ids) for g in gen[:3])
    assert usage["completion_tokens"] == 2 * sum(len(g.outputs[0].token_ids) for g in gen[:3])


def test_streamed_batch_with_n(server, reference):
    """Streamed: every choice of every prompt arrives, ends, and equals the plain response;
    continuous_usage_stats puts usage on every chunk."""
    gen, _ = reference
    body = {"model": "tiny", "prompt": PROMPTS[:2], "n": 2, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}}
    status, events = run(_stream_once(server, C, body))
    assert status == 200 and events[-1] == "[DONE]"
    texts, finished = {}, {}
    for e in events[:-1]:
        assert "usage" in e
        for ch in e["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"]:
                finished[ch["index"]] = ch["finish_reason"]
    assert sorted(texts) == sorted(finished) == [0, 1, 2, 3]
    for i in range(4):
        assert texts[i] == gen[i // 2].outputs[0].text
    assert events[-2]["usage"]["completion_tokens"] == \
        2 * sum(len(g.outputs[0].token_ids) for g in gen[:2])


def test_greedy_chat_matches_llm_chat(server, reference):
    _, chat = reference
    for conv, ref in zip(CHATS, chat):
        body = {"model": "tiny-alias", "messages": conv, "max_tokens": MAX_TOKENS,
                "temperature": 0, "return_token_ids": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200
        res = r.json()
        check_shape(res, "chatcmpl", "chat.completion")
        assert res["model"] == "tiny-alias"
        choice = res["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": ref.outputs[0].text}
        assert choice["token_ids"] == ref.outputs[0].token_ids
        assert res["prompt_token_ids"] == ref.prompt_token_ids
        assert choice["finish_reason"] == ref.outputs[0].finish_reason

        status, events = run(_stream_once(server, "/v1/chat/completions", {
            **body, "stream_options": {"include_usage": True}}))
        assert status == 200 and events[-1] == "[DONE]"
        check_shape(events[0], "chatcmpl", "chat.completion.chunk")
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in e["choices"][0]["delta"] for e in events[1:-2])
        text, ids, finish = joined(events, key="delta")
        assert (text, ids, finish) == (ref.outputs[0].text, ref.outputs[0].token_ids,
                                       ref.outputs[0].finish_reason)
        assert events[-2]["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


async def _stream_once(server, path, body):
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
        return await stream(c, path, body)


def test_openai_client(server, reference):
    gen, chat = reference
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    res = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert res.choices[0].text == gen[0].outputs[0].text
    assert res.usage.completion_tokens == len(gen[0].outputs[0].token_ids)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True)]
    assert "".join(pieces) == gen[0].outputs[0].text
    res = client.chat.completions.create(model="tiny", messages=CHATS[0],
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert res.choices[0].message.content == chat[0].outputs[0].text
    chunks = list(client.chat.completions.create(
        model="tiny", messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat[0].outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(chat[0].outputs[0].token_ids)
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w1", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="w1", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_bench_openai_backend(server):
    """Our benchmark client (`llmaccel bench`'s openai backend) against this server: both
    endpoints, token-id and text prompts, usage-based token counts, a failure counted."""
    from llmaccel.bench.backends.base import BenchRequest
    from llmaccel.bench.backends.openai_client import OpenAIBackend

    async def go(endpoint: str, model: str, prompts: list) -> tuple[list, OpenAIBackend]:
        backend = OpenAIBackend(server.url, model, endpoint=endpoint)
        await backend.start()
        try:
            return await asyncio.gather(*(backend.generate(BenchRequest(
                p, len(p) if isinstance(p, list) else 3, max_tokens=8)) for p in prompts)), \
                backend
        finally:
            await backend.close()

    for endpoint, prompts in ((C, [[5, 6, 7], [8] * 20, "w1 w2 w3"]),
                              (CHAT, ["w1 w2 w3", "w4"])):
        results, backend = run(go(endpoint, "tiny", prompts))
        assert all(r.success for r in results), [r.error for r in results]
        assert [r.output_len for r in results] == [8] * len(prompts)  # ignore_eos honoured
        assert all(r.ttft is not None and r.latency >= r.ttft for r in results)
        assert all(len(r.itl) >= 1 for r in results)
        assert backend.facts()["token_count"] == "usage.completion_tokens"
    results, _ = run(go(C, "nope", [[5, 6]]))
    assert not results[0].success and "404" in results[0].error


def test_sampling_options(server):
    url = server.url

    def complete(**body):
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": "w1 w2", **body})
        assert r.status_code == 200, r.text
        return r.json()

    # a seed makes sampling reproducible; n choices differ from each other (seed + i)
    a = complete(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    b = complete(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len({c["text"] for c in a["choices"]}) > 1
    # top_p near 0 keeps only the most likely token: greedy
    greedy = complete(temperature=0, max_tokens=8, ignore_eos=True)["choices"][0]["text"]
    assert complete(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True,
                    seed=1)["choices"][0]["text"] == greedy
    # logprobs: the sampled token and the top 2 alternatives, per token
    res = complete(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2,
                   return_token_ids=True)["choices"][0]
    lp = res["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert len(res["token_ids"]) == 6
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and top[token] == value and len(top) == 2  # greedy: it is the top
        assert value == max(top.values())
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": CHATS[0], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 3}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 3 for t in content)
    assert all(t["top_logprobs"][0]["token"] == t["token"] for t in content)  # greedy
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)


def test_stop_strings_streamed_and_not(server):
    """A stop string of two words from the greedy text: the output ends before it, also when
    streamed (text that might begin a stop string is held back, never taken back)."""
    base = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "w3 w4 w5", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}).json()["choices"][0]["text"]
    words = base.split()
    stop = " ".join(words[4:6])
    expected = base[:base.index(stop)].rstrip(" ") if stop in base else None
    body = {"model": "tiny", "prompt": "w3 w4 w5", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stop": [stop, "never"]}
    res = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    choice = res["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert stop not in choice["text"] and base.startswith(choice["text"])
    assert choice["text"].rstrip(" ") == expected
    status, events = run(_stream_once(server, "/v1/completions", body))
    text, _, finish = joined(events)
    assert status == 200 and text == choice["text"] and finish == "stop"
    # stop_token_ids: the first greedy token ends it at once
    first = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "w3 w4 w5", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]["token_ids"][0]
    res = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "w3 w4 w5", "max_tokens": 4, "temperature": 0,
        "stop_token_ids": [first]}).json()["choices"][0]
    assert res["finish_reason"] == "stop" and res["stop_reason"] == first


# -- bad inputs --------------------------------------------------------------------------------
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = {"model": "tiny", "messages": CHATS[0]}
BAD = [  # (path, body (str: raw bytes), status, param)
    (C, "{bad json", 400, None),
    (C, "[1, 2]", 400, None),
    (C, {"model": "tiny"}, 400, "prompt"),
    (C, {"model": "tiny", "prompt": "w1", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"model": "tiny", "prompt": "w1", "temperature": "hot"}, 400, "temperature"),
    (C, {"model": "tiny", "prompt": "w1", "stream": "yes"}, 400, "stream"),
    (C, {"model": "tiny", "prompt": [1, "w2"]}, 400, "prompt"),
    (C, {"model": "tiny", "prompt": "w1", "stop": 5}, 400, "stop"),
    (C, {"model": "nope", "prompt": "w1"}, 404, "model"),
    (C, {"model": "tiny", "prompt": "w1", "temperature": -0.5}, 400, "temperature"),
    (C, {"model": "tiny", "prompt": "w1", "top_p": 0}, 400, "top_p"),
    (C, {"model": "tiny", "prompt": "w1", "top_p": 1.5}, 400, "top_p"),
    (C, {"model": "tiny", "prompt": "w1", "n": 0}, 400, "n"),
    (C, {"model": "tiny", "prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"model": "tiny", "prompt": "w1", "logprobs": 21}, 400, "logprobs"),
    (C, {"model": "tiny", "prompt": "w1", "seed": -1}, 400, "seed"),
    (C, {"model": "tiny", "prompt": "w1", "min_tokens": 9, "max_tokens": 5}, 400, None),
    (C, {"model": "tiny", "prompt": "w1", "stop": [""]}, 400, None),
    (C, {"model": "tiny", "prompt": "w1", "stop_token_ids": [10_000]}, 400, "stop_token_ids"),
    (C, {"model": "tiny", "prompt": "w1", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    (C, {"model": "tiny", "prompt": "w1", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    (C, {"model": "tiny", "prompt": "w1", "echo": True}, 400, "echo"),
    (C, {"model": "tiny", "prompt": "w1", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    (C, {"model": "tiny", "prompt": "w1 " * 300}, 400, "prompt"),          # > max_model_len
    (C, {"model": "tiny", "prompt": "w1 w2", "max_tokens": 255}, 400, "max_tokens"),
    (C, {"model": "tiny", "prompt": []}, 400, "prompt"),
    (C, {"model": "tiny", "prompt": [[]]}, 400, None),                     # the engine's
    (C, {"model": "tiny", "prompt": [999]}, 400, None),                    # outside vocab
    (C, {"model": "tiny", "prompt": [999], "stream": True}, 400, None),    # before streaming
    (C, {"model": "tiny", "prompt": "w1 \ud800 w2"}, 400, "prompt"),      # a lone surrogate
    (C, {"model": "tiny", "prompt": "w1", "stop": ["x"] * 65}, 400, "stop"),
    (C, {"model": "tiny", "prompt": "w1", "stop": "x" * 1025}, 400, "stop"),
    (C, {"model": "tiny", "prompt": "w1", "stop_token_ids": [1] * 1025}, 400, "stop_token_ids"),
    (C, {"model": "tiny", "prompt": "w1", "stream": True, "temperature": -1}, 400,
     "temperature"),
    (CHAT, {"model": "tiny", "messages": []}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": "w1"}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "w1"}]}, 400,
     "messages"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    (CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {**OK_CHAT, "max_tokens": 1000}, 400, "max_tokens"),
    (CHAT, {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    (CHAT, {**OK_CHAT, "model": "nope", "stream": True}, 404, "model"),
]


def test_bad_inputs_get_4xx_and_the_server_keeps_serving(server):
    before = get_metrics(server.url)
    sent: dict[tuple[str, int], int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for path, body, status, param in BAD:
            content = body if isinstance(body, str) else json.dumps(body)
            r = client.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["code"] == status and err["param"] == param, (body, err)
            assert err["message"] and err["type"].endswith("Error")
            sent[path, status] = sent.get((path, status), 0) + 1
        r = client.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        r = client.post("/v1/models")
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        r = client.post(C, json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    after = get_metrics(server.url)
    for (path, status), count in sent.items():
        name = "llmaccel:http_responses_total"
        assert metric(after, name, route=path, status=str(status)) - \
            metric(before, name, route=path, status=str(status)) == count
    # none of them reached the engine: one finished request (the good one) since `before`
    assert metric(after, "llmaccel:request_success_total") - \
        metric(before, "llmaccel:request_success_total") == 1
    wait_until(server.idle, what="an idle server")


def test_an_internal_error_is_a_counted_500_without_its_text(server, monkeypatch):
    state = server.app.state.serving

    def boom(name):
        raise RuntimeError("secret detail /home/someone/model")

    before = get_metrics(server.url)
    monkeypatch.setattr(state, "resolve_model", boom)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post(C, json={"model": "tiny", "prompt": "w1", "max_tokens": 2})
    monkeypatch.undo()
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == 500 and "secret" not in r.text and "RuntimeError" not in r.text
    after = get_metrics(server.url)
    name = "llmaccel:http_responses_total"
    assert metric(after, name, route=C, status="500") - \
        metric(before, name, route=C, status="500") == 1
    wait_until(server.idle, what="an idle server")


def test_a_request_that_fails_in_the_engine_fails_alone(server, monkeypatch):
    """A request whose data makes the engine's step fail (here from its third token on) gets a
    500, or, streamed, an error event, without the exception's text; requests beside it finish
    normally."""
    runner = server.app.state.serving.engine.engine.runner
    real_execute = runner.execute

    def execute(step, *args):
        if any(7 in seq.prompt_token_ids and len(seq.output_token_ids) >= 2
               for seq, _ in step.scheduled):
            raise RuntimeError("simulated fault /secret/path")
        return real_execute(step, *args)

    before = get_metrics(server.url)
    monkeypatch.setattr(runner, "execute", execute)
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(
                post(c, C, {**body, "prompt": [10, 11, 12]}),
                stream(c, C, {**body, "prompt": [10, 11, 12]}),
                post(c, C, {**body, "prompt": [5, 7, 9]}),
                stream(c, C, {**body, "prompt": [5, 7, 9]}))

    (s1, ok), (s2, ok_events), (s3, bad), (s4, bad_events) = run(main())
    monkeypatch.undo()
    assert s1 == 200 and ok["usage"]["completion_tokens"] == 6
    assert s2 == 200 and joined(ok_events)[0] == ok["choices"][0]["text"]
    assert s3 == 500 and bad["error"]["code"] == 500 and "simulated" not in str(bad)
    errors = [e for e in bad_events if e != "[DONE]" and "error" in e]
    assert s4 == 200 and len(errors) == 1 and errors[0]["error"]["code"] == 500
    assert "simulated" not in str(bad_events) and bad_events[-1] == "[DONE]"
    after = get_metrics(server.url)
    name = "llmaccel:request_success_total"
    assert metric(after, name, finished_reason="error") - \
        metric(before, name, finished_reason="error") == 2
    wait_until(server.idle, what="an idle server")


# -- concurrency, disconnects, metrics ---------------------------------------------------------
def test_concurrent_clients_and_metrics(server, reference):
    """24 clients at once, every kind of request; then /metrics counts exactly what was sent
    and every KV block is free."""
    gen, _ = reference
    before = get_metrics(server.url)
    clients = 24

    async def one(c: httpx.AsyncClient, i: int):
        kind = i % 4
        body = {"model": "tiny", "max_tokens": 4 + i % 7, "temperature": 0 if i % 3 else 0.8,
                "seed": i, "return_token_ids": True}
        if kind < 2:
            body["prompt"] = PROMPTS[i % len(PROMPTS)]
            path = C
        else:
            body["messages"] = CHATS[i % 2]
            path = CHAT
        if kind % 2:
            status, events = await stream(c, path, {**body, "stream_options":
                                                    {"include_usage": True}})
            assert status == 200 and events[-1] == "[DONE]"
            assert joined(events, "text" if path == C else "delta")[2] in ("stop", "length")
            return path, body, events[-2]["usage"], None
        status, res = await post(c, path, body)
        assert status == 200, res
        assert res["choices"][0]["finish_reason"] in ("stop", "length")
        return path, body, res["usage"], res

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(clients)))

    results = run(go())
    wait_until(server.idle, what="an idle server")
    # greedy non-streamed completions equal LLM.generate's (first max_tokens tokens)
    for path, body, _, res in results:
        if res is not None and path == C and body["temperature"] == 0:
            ref = gen[PROMPTS.index(body["prompt"])].outputs[0]
            ids = res["choices"][0]["token_ids"]
            assert ids and ids == ref.token_ids[:len(ids)]
    after = get_metrics(server.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    usages = [u for _, _, u, _ in results]
    assert delta("llmaccel:request_success_total") == clients
    assert delta("llmaccel:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("llmaccel:generation_tokens_total") == \
        sum(u["completion_tokens"] for u in usages)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"llmaccel:{hist}_count") == clients
    assert delta("llmaccel:inter_token_latency_seconds_count") > 0
    assert delta("llmaccel:http_responses_total", route=C, status="200") + \
        delta("llmaccel:http_responses_total", route=CHAT, status="200") == clients
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(after, f"llmaccel:{gauge}") == 0
    for name in ("prefix_cache_hit_rate", "num_preemptions_total"):
        assert f"llmaccel:{name}" in after
    assert metric(after, "llmaccel:prefix_cache_hit_rate") > 0  # the prompts repeat
    assert server.used_blocks == 0


def test_client_disconnects_abort_their_requests(server):
    """A stream closed after its first chunk, and a plain request whose socket closes while it
    runs: both aborted (not run to max_tokens), their KV blocks freed."""
    before = get_metrics(server.url)
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": LONG, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", C, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and json.loads(line[5:])["choices"][0]["text"]:
                    break  # one token arrived: leave, closing the connection
    wait_until(server.idle, what="the stream aborted")
    sock = raw_post(server.port, C, body)
    wait_until(server.engine.engine.has_unfinished_requests, what="the plain request to start")
    sock.close()
    wait_until(server.idle, what="the plain request aborted")
    after = get_metrics(server.url)
    assert metric(after, "llmaccel:request_success_total", finished_reason="abort") - \
        metric(before, "llmaccel:request_success_total", finished_reason="abort") == 2
    generated = metric(after, "llmaccel:generation_tokens_total") - \
        metric(before, "llmaccel:generation_tokens_total")
    assert generated < 2 * LONG
    assert metric(after, "llmaccel:http_responses_total", route=C, status="499") - \
        metric(before, "llmaccel:http_responses_total", route=C, status="499") == 1
    assert server.used_blocks == 0


def test_health_models_metrics_version(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == \
        [("tiny", "model", 256), ("tiny-alias", "model", 256)]
    # the model directory by its name, not the server's absolute path
    root = server.app.state.serving.settings.model_root
    assert {m["root"] for m in models["data"]} == {Path(root).name} and "/" not in Path(root).name
    text = get_metrics(server.url)
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total"):
        assert f"llmaccel:{name}" in text, name
    assert "spec_decode_acceptance_rate" not in text  # no speculation on this engine
    schema = httpx.get(server.url + "/openapi.json").json()  # FastAPI's docs still build
    assert {"/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])


def test_speculative_server(model_dir, reference):
    """With n-gram speculation: the same greedy outputs, and acceptance in /metrics."""
    gen, _ = reference
    engine = AsyncLLM.from_config(str(model_dir), **engine_kwargs(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    srv = ServerThread(engine, ServerSettings(served_model_names=("tiny",))).start()
    try:
        for prompt, ref in zip(PROMPTS, gen):
            r = httpx.post(srv.url + C, timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert r.json()["choices"][0]["text"] == ref.outputs[0].text
        text = get_metrics(srv.url)
        stats = engine.engine.get_stats().spec_decode
        assert stats["num_draft_tokens"] > 0
        assert metric(text, "llmaccel:spec_decode_acceptance_rate") == \
            pytest.approx(stats["acceptance_rate"])
        assert metric(text, "llmaccel:spec_decode_num_draft_tokens_total") == \
            stats["num_draft_tokens"]
        assert metric(text, "llmaccel:spec_decode_num_accepted_tokens_total") == \
            stats["num_accepted_tokens"]
    finally:
        srv.stop()
    assert srv.idle()


def test_quantization_option(model_dir):
    """--quantization: random codes of the scheme with dummy weights; otherwise the model is
    quantized first (RTN int8 here) and the result loads; an already quantized one is refused."""
    import contextlib

    from llmaccel.errors import LLMAccelError
    from llmaccel.cli.serve import _prepare_model

    with contextlib.ExitStack() as stack:
        assert _prepare_model(str(model_dir), None, None, "auto", "cpu", stack) == \
            (str(model_dir), None)
        path, overrides = _prepare_model(str(model_dir), "rtn-int8", None, "dummy", "cpu",
                                         stack)
        assert overrides["quantization_config"]["quant_method"] == "compressed-tensors"
        path, overrides = _prepare_model(str(model_dir), "rtn-int8", None, "auto", "cpu", stack)
        assert overrides is None
        llm = LLM(path, **engine_kwargs())
        assert llm.engine.model_config.quant_config is not None
        assert llm.generate(["w1 w2"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        with pytest.raises(LLMAccelError, match="already quantized"):
            _prepare_model(path, "rtn-int8", None, "auto", "cpu", stack)
        with pytest.raises(LLMAccelError):
            _prepare_model(str(model_dir), "int3", None, "auto", "cpu", stack)


# -- a second server: auth, admission control --------------------------------------------------
@pytest.fixture
def small_server(model_dir):
    """One sequence at a time, at most 2 waiting, an API key."""
    engine = AsyncLLM.from_config(str(model_dir), **engine_kwargs(max_num_seqs=1))
    srv = ServerThread(engine, ServerSettings(served_model_names=("tiny",), api_key="sekret",
                                              max_waiting=2)).start()
    yield srv
    srv.stop()


AUTH = {"Authorization": "Bearer sekret"}


def test_api_key(small_server):
    url = small_server.url + C
    body = {"model": "tiny", "prompt": "w1", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                    {"Authorization": "Bearer sekret2"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(small_server.url + "/v1/models").status_code == 401
    for path in ("/docs", "/redoc", "/openapi.json"):  # the API's description too
        assert httpx.get(small_server.url + path).status_code == 401, path
        assert httpx.get(small_server.url + path, headers=AUTH).status_code == 200, path
    assert httpx.post(url, json=body, headers=AUTH).status_code == 200
    assert httpx.get(small_server.url + "/health").status_code == 200  # open, as in vLLM
    assert httpx.get(small_server.url + "/metrics").status_code == 200
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="sekret", max_retries=0)
    assert client.completions.create(model="tiny", prompt="w1", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=small_server.url + "/v1", api_key="bad",
                      max_retries=0).models.list()


def test_admission_control(small_server):
    """One running (max_num_seqs=1) and two waiting: the next request gets 503 with
    Retry-After. A waiting client that leaves is aborted from the queue; the rest finish."""
    state = small_server.app.state.serving
    long = {"model": "tiny", "prompt": "w1 w2", "max_tokens": LONG, "ignore_eos": True,
            "stream": True}
    running = raw_post(small_server.port, C, long, AUTH)
    got = read_until(running, b"data: {")  # its first token: it is running
    short = {"model": "tiny", "prompt": "w3", "max_tokens": 3, "ignore_eos": True}
    waiting = [raw_post(small_server.port, C, short, AUTH) for _ in range(2)]
    wait_until(lambda: state.waiting == 2, what="two waiting requests")
    r = httpx.post(small_server.url + C, json=short, headers=AUTH)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    wait_until(lambda: metric(get_metrics(small_server.url),
                              "llmaccel:num_requests_waiting") == 2, what="engine gauge")
    waiting[0].close()  # gives up while queued
    wait_until(lambda: state.waiting == 1, what="the queued request aborted")
    running.close()  # the running one leaves: the last waiting one runs
    status, body = read_response(waiting[1])
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"
    wait_until(small_server.idle, what="an idle server")
    # more prompts than may ever wait: no retry can help, so a 400 naming the limit, not a 503
    r = httpx.post(small_server.url + C, json={**short, "prompt": ["w1", "w2", "w3"]},
                   headers=AUTH)
    assert r.status_code == 400 and "--max-waiting" in r.json()["error"]["message"]
    # n completions of one prompt take one place
    r = httpx.post(small_server.url + C, json={**short, "n": 3}, headers=AUTH)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    text = get_metrics(small_server.url)
    assert metric(text, "llmaccel:request_success_total", finished_reason="abort") == 2
    assert metric(text, "llmaccel:http_responses_total", route=C, status="503") == 1
    assert got.startswith(b"HTTP/1.1 200")


# -- shutdown ----------------------------------------------------------------------------------
def _fresh_server(model_dir, **settings) -> ServerThread:
    engine = AsyncLLM.from_config(str(model_dir), **engine_kwargs())
    return ServerThread(engine, ServerSettings(served_model_names=("tiny",), **settings)).start()


def test_shutdown_lets_requests_finish(model_dir):
    srv = _fresh_server(model_dir, shutdown_timeout_s=60)
    sock = raw_post(srv.port, C, {"model": "tiny", "prompt": "w1", "max_tokens": 12,
                                  "ignore_eos": True, "stream": True, "return_token_ids": True})
    got = read_until(sock, b"data: {")
    srv.server.should_exit = True  # as SIGTERM does
    status, body = read_response(sock, got)
    events = sse_events(body.decode().splitlines())
    assert status == 200 and events[-1] == "[DONE]"
    assert joined(events)[2] == "length" and len(joined(events)[1]) == 12
    srv.stop()
    assert srv.idle()
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")


def test_shutdown_aborts_requests_past_the_timeout(model_dir):
    srv = _fresh_server(model_dir, shutdown_timeout_s=0)
    body = {"model": "tiny", "prompt": "w1", "max_tokens": LONG, "ignore_eos": True}
    streaming = raw_post(srv.port, C, {**body, "stream": True})
    got = read_until(streaming, b"data: {")
    plain = raw_post(srv.port, CHAT, {"model": "tiny", "messages": CHATS[0], "max_tokens": LONG,
                                      "ignore_eos": True})
    wait_until(lambda: len(srv.engine.engine.requests) == 2, what="both requests running")
    srv.server.should_exit = True
    status, raw = read_response(streaming, got)
    events = sse_events(raw.decode().splitlines())
    assert status == 200 and events[-1] == "[DONE]" and joined(events)[2] == "abort"
    status, raw = read_response(plain)
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "abort"
    srv.stop()
    assert srv.idle()


# -- the command -------------------------------------------------------------------------------
def test_serve_command(model_dir):
    """`serve` as the CLI runs it, in its own process: answers, then stops on SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import typer; from llmaccel.cli.serve import serve; "
            "app = typer.Typer(); app.command()(serve); app()")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(model_dir), "--port", str(port), "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks", "64",
         "--served-model-name", "tiny", "--api-key", "k", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 120, "the server to start")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={
            "Authorization": "Bearer k"}, json={"model": "tiny", "prompt": "w1", "max_tokens": 3},
            timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down, so a manager sees it: -15
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read()
    assert "serving tiny" in log and "Application shutdown complete" in log, log


def test_a_server_without_tokenizer_streams_token_ids(model_dir):
    """A benchmark shape or --skip-tokenizer-init has no text to send: every choice carries
    its token ids and every step is a chunk, so `llmaccel bench --backend openai` times each
    token (it once saw one empty chunk per request and counted no output at all)."""
    from llmaccel.bench.backends.base import BenchRequest
    from llmaccel.bench.backends.openai_client import OpenAIBackend

    engine = AsyncLLM.from_config(str(model_dir), **engine_kwargs(skip_tokenizer_init=True))
    srv = ServerThread(engine, ServerSettings(served_model_names=("tiny",))).start()
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True,
                "temperature": 0}
        code, resp = run(post_once(srv.url + C, body))
        assert code == 200 and len(resp["choices"][0]["token_ids"]) == 6
        status, events = run(stream_once(srv.url + C, {**body, "stream": True}))
        text, ids, finish = joined(events)
        assert status == 200 and ids == resp["choices"][0]["token_ids"] and finish == "length"
        assert len(events) >= 3  # several chunks (+ [DONE]), not one at the end

        async def bench():
            backend = OpenAIBackend(srv.url, "tiny")
            await backend.start()
            try:
                return await backend.generate(BenchRequest([5, 6, 7], 3, max_tokens=6))
            finally:
                await backend.close()
        r = run(bench())
        assert r.success and r.output_len == 6 and len(r.itl) >= 1
    finally:
        srv.stop()
    assert srv.used_blocks == 0


async def post_once(url: str, body: dict) -> tuple[int, dict]:
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(url, json=body)
        return r.status_code, r.json()


async def stream_once(url: str, body: dict) -> tuple[int, list]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await stream(client, url, body)


def test_cors_is_off_by_default_and_follows_allowed_origins(server, model_dir):
    from llmaccel.cli.serve import parse_origins

    origin = {"Origin": "https://app.example"}
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models",
                                                           headers=origin).headers
    assert parse_origins(['["https://a.example", "https://b.example"]', "https://c.example"]) \
        == ("https://a.example", "https://b.example", "https://c.example")
    engine = AsyncLLM.from_config(str(model_dir), **engine_kwargs())
    srv = ServerThread(engine, ServerSettings(served_model_names=("tiny",), api_key="sekret",
                                              allowed_origins=("https://app.example",))).start()
    try:
        preflight = {**origin, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        r = httpx.options(srv.url + C, headers=preflight)  # no key: browsers send none here
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.options(srv.url + C, headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        r = httpx.post(srv.url + C, json={"model": "tiny", "prompt": "w1", "max_tokens": 2},
                       headers={**origin, **AUTH})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        srv.stop()


def test_oversized_bodies_get_413_unread_and_long_texts_400_untokenized(model_dir):
    engine = AsyncLLM.from_config(str(model_dir), **engine_kwargs())
    srv = ServerThread(engine, ServerSettings(served_model_names=("tiny",),
                                              max_request_body_bytes=4096)).start()
    try:
        big = {"model": "tiny", "prompt": "w1 " * 2000, "max_tokens": 2}
        r = httpx.post(srv.url + C, json=big)
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == 413 and "4,096 bytes" in err["message"]
        # a declared length past the limit is refused before a byte of the body is sent
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000000000\r\n\r\n")
        status, _ = read_response(sock)
        assert status == 413
        sock.close()

        def chunked():  # no length given: counted as it arrives
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(100):
                yield b"w1 " * 100
            yield b'"}'

        r = httpx.post(srv.url + C, content=chunked(),
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        # within the limit but more characters than the context can hold as tokens
        state = srv.app.state.serving
        n = state.max_model_len * state.longest_token + 1
        r = httpx.post(srv.url + C, json={"model": "tiny", "prompt": "w" * n, "max_tokens": 2})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
        r = httpx.post(srv.url + C, json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 2})
        assert r.status_code == 200
        text = get_metrics(srv.url)
        assert metric(text, "llmaccel:http_responses_total", route=C, status="413") == 3
    finally:
        srv.stop()


def test_a_slow_tokenization_does_not_stall_other_requests(server, monkeypatch):
    """Prompts are tokenized off the event loop, a long one in a lane of its own: while one
    takes seconds, a short request is answered as fast as on an idle server."""
    import llmaccel.server.state as state_module

    state = server.app.state.serving

    class SlowTokenizer:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def __call__(self, text, *args, **kwargs):
            if "w99" in text:
                time.sleep(3.0)
            return self.real(text, *args, **kwargs)

    # this model's context holds too few characters for a long prompt: lower the threshold
    monkeypatch.setattr(state_module, "LARGE_TEXT_CHARS", len("w1 w2"))
    monkeypatch.setattr(state, "_tokenizers", tuple(SlowTokenizer(t) for t in state._tokenizers))
    body = {"model": "tiny", "max_tokens": 2}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            slow = asyncio.ensure_future(post(c, C, {**body, "prompt": "w99 w1"}))
            await asyncio.sleep(0.3)  # the slow one is being tokenized
            start = time.perf_counter()
            status, _ = await post(c, C, {**body, "prompt": "w1 w2"})
            quick = time.perf_counter() - start
            return status, quick, await slow

    status, quick, (slow_status, _) = run(main())
    assert status == 200 and slow_status == 200
    assert quick < 1.5, f"a short request took {quick:.1f}s behind a slow tokenization"


def test_connections_without_a_request_head_are_closed(model_dir):
    srv = _fresh_server(model_dir, header_timeout_s=0.5)
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(10)]
        half = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(10)]
        for s in half:  # a head that never ends
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        # a request running past the deadline is not cut: the deadline covers heads only
        body = {"model": "tiny", "prompt": "w1", "max_tokens": LONG, "ignore_eos": True,
                "stream": True}
        sock = raw_post(srv.port, C, body)
        status, raw = read_response(sock)
        assert status == 200 and sse_events(raw.decode().splitlines())[-1] == "[DONE]"
        for s in idle + half:
            s.settimeout(10)
            try:
                assert s.recv(1024) == b""  # closed by the server
            except ConnectionResetError:
                pass
            s.close()
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()
