"""The `openai` backend's client against a minimal in-test HTTP server that streams SSE as an
OpenAI-compatible completions endpoint does. This is a client-parsing test only (timing,
usage, errors, failures counted): it says nothing about any real server; the test against
our own server comes with it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from llmaccel.bench.backends.base import BenchRequest
from llmaccel.bench.backends.openai_client import OpenAIBackend, chunk_text, sse_data

GAP_S = 0.03


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.seen.append({"path": self.path, "auth": self.headers.get("Authorization"),
                              **body})
        if body.get("model") not in ("tiny", "tiny-nousage"):
            payload = json.dumps({"error": {"message": "model not found",
                                            "type": "NotFoundError", "code": 404}}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        chat = self.path.endswith("chat/completions")
        if chat:  # a role-only first chunk carries no text and must not count as a token
            self._send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(n):
            time.sleep(GAP_S)
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else \
                {"index": 0, "text": f"t{i} "}
            self._send({"choices": [choice]})
        if body["model"] == "tiny":
            self._send({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _run(backend, requests):
    async def go():
        await backend.start()
        try:
            return await asyncio.gather(*(backend.generate(r) for r in requests))
        finally:
            await backend.close()
    return asyncio.run(go())


def test_sse_parsing():
    assert sse_data("data: {\"a\": 1}") == "{\"a\": 1}" and sse_data("data:[DONE]") == "[DONE]"
    assert sse_data("") is None and sse_data(": keep-alive") is None
    assert sse_data("event: x") is None
    assert chunk_text({"choices": [{"text": "hi"}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) is None
    assert chunk_text({"choices": [], "usage": {}}) is None
    assert chunk_text({"choices": [{"text": "", "finish_reason": "length"}]}) is None
    assert chunk_text({"choices": [{"text": "", "token_ids": [7]}]}) == ""


def test_streamed_timing_usage_and_payload(server):
    _Handler.seen.clear()
    b = OpenAIBackend(server, "tiny", "fake", api_key="sk-test")
    (r,) = _run(b, [BenchRequest([5, 6, 7], 3, 4)])
    assert r.success and r.output_len == 4 and r.generated_text == "t0 t1 t2 t3 "
    assert r.ttft >= GAP_S * 0.9 and len(r.itl) == 3
    # Chunk i leaves the server (i + 1) gaps after the request; a busy client may read late
    # (two chunks in one read), so only arrival times are bounded, never single ITLs.
    arrivals = [r.ttft + sum(r.itl[:i]) for i in range(4)]
    assert all(t >= (i + 1) * GAP_S * 0.9 for i, t in enumerate(arrivals))
    assert all(g >= 0 for g in r.itl)
    assert r.latency == pytest.approx(r.ttft + sum(r.itl), rel=1e-6)
    sent = _Handler.seen[-1]
    assert sent["prompt"] == [5, 6, 7] and sent["stream"] is True
    assert sent["ignore_eos"] is True and sent["temperature"] == 0.0
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["auth"] == "Bearer sk-test" and sent["path"] == "/v1/completions"
    assert b.facts()["token_count"] == "usage.completion_tokens"


def test_chat_endpoint_and_a_server_without_usage(server):
    b = OpenAIBackend(server, "tiny-nousage", endpoint="/v1/chat/completions")
    (r,) = _run(b, [BenchRequest("hello", 1, 3)])
    assert r.success and r.output_len == 3 and len(r.itl) == 2  # the role chunk is not a token
    assert b.counted_chunks and "chunks" in b.facts()["token_count"]
    with pytest.raises(ValueError, match="token ids"):
        b.payload(BenchRequest([1, 2], 2, 3))


def test_errors_become_failed_results(server):
    (r,) = _run(OpenAIBackend(server, "no-such-model"), [BenchRequest([1], 1, 2)])
    assert not r.success and "HTTP 404" in r.error and "model not found" in r.error
    (r,) = _run(OpenAIBackend("http://127.0.0.1:9", "tiny"), [BenchRequest([1], 1, 2)])
    assert not r.success and r.error  # connection refused, counted as a failure
    with pytest.raises(ValueError, match="endpoint"):
        OpenAIBackend(server, "tiny", endpoint="/v1/embeddings")


def test_bench_serve_cli_against_the_fake_server(server, tmp_path):
    from llmaccel.cli import app

    r = CliRunner().invoke(app, [
        "bench", "serve", "tiny", "--backend", "openai", "--base-url", server,
        "--server-name", "fake", "--vocab-size", "100", "--quick", "--request-rate", "inf",
        "--max-concurrency", "2,4", "--goodput", "ttft:5000", "--usd-per-gpu-hour", "2.5",
        "--out", str(tmp_path), "--name", "w3", "--no-progress"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    records = [json.loads(x) for x in (tmp_path / "w3.jsonl").read_text().splitlines()]
    by = {(x["config"]["load"], x["metric"]): x for x in records}
    for load in ("concurrency=2", "concurrency=4"):
        assert by[(load, "completed")]["value"] == 8 and by[(load, "failed")]["value"] == 0
        assert by[(load, "goodput")]["value"] > 0 and by[(load, "usd_per_m_out_tok")]["value"]
        assert by[(load, "out_tok_s")]["backend"] == "openai:fake"
        assert by[(load, "ttft_ms_p99")]["load_format"] == "remote"
    # four in flight finish the same 8 requests faster than two
    assert by[("concurrency=4", "out_tok_s")]["value"] > by[("concurrency=2", "out_tok_s")]["value"]
    rows = [json.loads(x) for x in (tmp_path / "w3.requests.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["success"] for r in rows)
    assert "W3 serving" in (tmp_path / "w3.md").read_text()


def test_bench_cli_rejects_bad_options(tmp_path):
    from llmaccel.cli import app
    from llmaccel.errors import LLMAccelError

    runner = CliRunner()
    r = runner.invoke(app, ["bench", "serve", "tiny", "--backend", "openai", "--quick"])
    assert isinstance(r.exception, LLMAccelError) and "--base-url" in str(r.exception)
    r = runner.invoke(app, ["bench", "serve", "tiny", "--backend", "hf-eager"])
    assert isinstance(r.exception, LLMAccelError) and "runs llmaccel, openai" in str(r.exception)
    r = runner.invoke(app, ["bench", "serve", "--goodput", "itl:3", "--quick"])
    assert isinstance(r.exception, LLMAccelError) and "unknown SLO" in str(r.exception)
    r = runner.invoke(app, ["bench", "latency", "--engine-kw", "nope=1"])
    assert isinstance(r.exception, LLMAccelError) and "key one of" in str(r.exception)
    r = runner.invoke(app, ["bench", "serve", "x", "--backend", "openai", "--base-url",
                            "http://127.0.0.1:9", "--request-rate", "-1"])
    assert isinstance(r.exception, LLMAccelError) and "positive" in str(r.exception)
