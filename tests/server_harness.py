"""A real uvicorn server on 127.0.0.1 (a free port) in a background thread, over a tiny random
model with a word tokenizer and a chat template: what the server tests run against. Waits are
on conditions (polled, with a deadline that fails the test), never fixed sleeps."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tiny_models import make_tiny_model, save_word_tokenizer, tiny_configs

WORDS = [f"w{i}" for i in range(120)] + ["user", "assistant", "system", ":"]
# Every message's role and content, then the assistant's turn: words of the vocabulary only.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def make_model_dir(directory: Path) -> Path:
    """A tiny random Llama whose vocabulary is a word tokenizer's (with a chat template)."""
    from transformers import AutoTokenizer

    vocab = save_word_tokenizer(WORDS, directory)
    tok = AutoTokenizer.from_pretrained(directory)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    config = tiny_configs()["llama"]
    config.vocab_size = vocab
    make_tiny_model(config, directory)
    return directory


def engine_kwargs(**overrides) -> dict:
    kwargs = dict(dtype="float32", device="cpu", num_gpu_blocks=256, max_model_len=256,
                  enable_prefix_caching=True)
    kwargs.update(overrides)
    return kwargs


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        time.sleep(0.01)


class ServerThread:
    """build_app + DrainingServer on a socket bound here (so the port is known up front)."""

    def __init__(self, engine, settings) -> None:
        from llmaccel.server.app import build_app
        from llmaccel.server.runner import make_server

        self.engine = engine
        self.app = build_app(engine, settings)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, "127.0.0.1", self.port, log_level="warning",
                                  configure_logging=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name=f"uvicorn-{self.port}")

    def start(self) -> ServerThread:
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), 60, "start-up")
        assert self.server.started, "the server thread died during start-up"
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the server did not stop"

    @property
    def used_blocks(self) -> int:
        return self.engine.engine.block_manager.num_used_blocks

    def idle(self) -> bool:
        """No request left anywhere: the engine's, the server's, the KV blocks."""
        state = self.app.state.serving
        return (not self.engine.engine.has_unfinished_requests() and state.in_flight == 0
                and state.waiting == 0 and self.used_blocks == 0)


class ServerProcess:
    """`python -m llmaccel serve` in a process of its own: what a latency measurement needs
    (a server thread would share this process's interpreter lock with the clients)."""

    def __init__(self, model_dir: Path, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmaccel", "serve", str(model_dir), "--port", str(self.port),
             "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
             "--num-gpu-blocks", "256", "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def up() -> bool:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                return httpx.get(self.url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_until(up, 120, "the server process to start")
        except BaseException:
            self.stop()
            raise

    def idle(self) -> bool:
        """Nothing running or waiting, no KV block in use (from /metrics)."""
        text = get_metrics(self.url)
        return all(metric(text, "llmaccel:" + name) == 0 for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))

    def stop(self) -> str:
        """SIGTERM, then its output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stdout.read()


def sse_events(lines) -> list[dict | str]:
    """The data payloads of an SSE body: parsed JSON, or the literal '[DONE]'."""
    events = []
    for line in lines:
        if line.startswith("data:"):
            data = line[len("data:"):].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 if absent), summed over other labels."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def get_metrics(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=30)
    r.raise_for_status()
    return r.text


def raw_post(port: int, path: str, body: dict, headers: dict[str, str] | None = None
             ) -> socket.socket:
    """Send a POST on a socket of its own and return the socket unread: a client that can be
    made to vanish (close) at a chosen moment, which httpx does not offer for a request whose
    response has not begun."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n")
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(head.encode() + b"\r\n" + data)
    return sock


def read_until(sock: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    """Read until `marker` appears (or EOF); returns everything read."""
    while marker not in got:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def read_response(sock: socket.socket, got: bytes = b"") -> tuple[int, bytes]:
    """(status, body) of a `Connection: close` response: read to EOF, undo chunking."""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    head, _, body = got.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return status, body
