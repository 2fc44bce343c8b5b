"""Prometheus metrics of one server, in a registry of its own (not the process-global one), so
several apps can live in one process (tests). Names follow vLLM's with our prefix:
llmaccel:time_to_first_token_seconds, llmaccel:inter_token_latency_seconds,
llmaccel:e2e_request_latency_seconds, llmaccel:num_requests_running|waiting, ...

Latencies are taken in the server, close to what a client sees: from the moment a parsed and
tokenized request is handed to the engine to the arrival of the engine output that carried the
tokens (HTTP parsing, tokenization and the network are left out)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from llmaccel.engine.outputs import RequestOutput
from llmaccel.engine.stats import EngineStats

PREFIX = "llmaccel:"
# No `*_created` series (a timestamp per counter, doubling the page); as vLLM does. The switch
# is process-wide, which is what a server process wants anyway.
disable_created_metrics()
CONTENT_TYPE = CONTENT_TYPE_LATEST


def _buckets(lo: float, hi: float, per_decade: int = 4) -> list[float]:
    """Log-spaced bucket bounds from lo to hi: latencies span milliseconds to minutes."""
    out, v, step = [], lo, 10 ** (1 / per_decade)
    while v <= hi * 1.0001:
        out.append(float(f"{v:.3g}"))
        v *= step
    return out


@dataclass
class RequestTimer:
    """One engine request's timeline as the server saw it."""
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    tokens: int = 0          # output tokens seen so far, all choices
    prompt_tokens: int = 0
    done: bool = False


class ServerMetrics:
    def __init__(self, model_name: str, speculative: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, names = self.registry, ["model_name"]

        def counter(name: str, doc: str, labels: list[str] = names) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=r)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _buckets(0.001, 600))
        self.itl = histogram("inter_token_latency_seconds", "Time between the engine "
                             "outputs that carried new tokens of one request.",
                             _buckets(0.0005, 60))
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, accepted to "
                             "finished.", _buckets(0.005, 3600))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens",
                                         "Generated tokens of finished requests.")
        self.request_success = counter("request_success", "Finished requests by reason "
                                       "(stop, length, abort).", names + ["finished_reason"])
        self.http_responses = counter("http_responses", "HTTP responses by route and status.",
                                      names + ["route", "status"])
        self.running = gauge("num_requests_running", "Sequences the engine is running.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting for admission.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens served from "
                                     "the prefix cache / prompt tokens looked up (0-1).")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed).")
        self._preemptions_seen = 0
        self.acceptance_rate = None
        if speculative:  # absent rather than a misleading 0 when nothing is speculated
            self.acceptance_rate = gauge("spec_decode_acceptance_rate",
                                         "Accepted draft tokens / proposed draft tokens.")
            self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens.")
            self.accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Accepted draft tokens.")
            self._spec_seen = (0, 0)
        for metric in (self.ttft, self.itl, self.e2e, self.prompt_tokens,
                       self.generation_tokens, self.preemptions):
            metric.labels(model_name)  # exported at 0 before the first request

    # -- per request ---------------------------------------------------------------------------
    def on_output(self, timer: RequestTimer, out: RequestOutput) -> None:
        """An engine output reached the server: time its new tokens."""
        now = time.perf_counter()
        tokens = sum(len(c.token_ids) for c in out.outputs)
        timer.prompt_tokens = len(out.prompt_token_ids)
        if tokens > timer.tokens:
            if timer.last_token is None:
                self.ttft.labels(self.model_name).observe(now - timer.arrival)
            else:
                self.itl.labels(self.model_name).observe(now - timer.last_token)
            timer.last_token, timer.tokens = now, tokens
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
            self.on_finish(timer, reason)

    def on_finish(self, timer: RequestTimer, reason: str) -> None:
        if timer.done:
            return
        timer.done = True
        m = self.model_name
        self.e2e.labels(m).observe(time.perf_counter() - timer.arrival)
        self.prompt_tokens.labels(m).inc(timer.prompt_tokens)
        self.generation_tokens.labels(m).inc(timer.tokens)
        self.request_success.labels(m, reason).inc()

    def on_response(self, route: str, status: int) -> None:
        self.http_responses.labels(self.model_name, route, str(status)).inc()

    # -- scrape --------------------------------------------------------------------------------
    def update_engine(self, stats: EngineStats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.prefix_hit_rate.labels(m).set(stats.prefix_hit_rate)
        # The engine keeps running totals; a Prometheus counter only goes up by deltas.
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.labels(m).inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        spec = stats.spec_decode
        if self.acceptance_rate is not None and spec is not None:
            self.acceptance_rate.labels(m).set(spec.get("acceptance_rate") or 0.0)
            drafted, accepted = spec.get("num_draft_tokens", 0), spec.get("num_accepted_tokens", 0)
            seen_d, seen_a = self._spec_seen
            self.draft_tokens.labels(m).inc(max(0, drafted - seen_d))
            self.accepted_tokens.labels(m).inc(max(0, accepted - seen_a))
            self._spec_seen = (max(drafted, seen_d), max(accepted, seen_a))

    def render(self) -> bytes:
        return generate_latest(self.registry)
