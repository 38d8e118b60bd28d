"""The server's Prometheus metrics (prometheus_client), in a registry of its own so several apps in one process
(tests) do not collide. Served at GET /metrics in the text exposition format.

Every label has a bounded set of values, whatever the clients send: an endpoint is the route template a request
matched (`/v1/sessions/{session_id}/park`, not the session's id), or `unmatched`; a status is an HTTP status code;
a finish reason is one of `FINISH_REASONS`. Latencies are the engine's: a token's time is when the engine produced
it (`TokenOut.produced`), not when the HTTP side got round to sending it.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.routing import Match

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
UNMATCHED = "unmatched"  # the one endpoint label of every path no route has
# How a request that generated tokens ended: OpenAI's two finish reasons, the client going away, or an error.
FINISH_REASONS = ("length", "stop", "cancelled", "error")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("txl_requests", "HTTP requests answered, by endpoint (route template) and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("txl_prompt_tokens", "Prompt tokens fed", registry=r)
        self.generated_tokens = Counter("txl_generated_tokens", "Tokens generated, by how their request ended",
                                        ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self.generated_tokens.labels(finish_reason=reason)
        self.ttft = Histogram("txl_time_to_first_token_seconds",
                              "From a request's arrival to the engine producing its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("txl_inter_token_latency_seconds", "Between the engine producing two tokens of one stream",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("txl_batch_size", "Streams in one batched decode call", buckets=BATCH_BUCKETS,
                               registry=r)
        self.queue = Gauge("txl_queue_depth", "Requests waiting for a row", registry=r)
        self.running = Gauge("txl_running_streams", "Requests generating now", registry=r)
        self.sessions = Gauge("txl_sessions", "Live sessions", registry=r)
        self.session_bytes = Gauge("txl_session_bytes", "Bytes of the live sessions' memories", registry=r)

    def watch(self, engine):
        """Gauges read from the engine when scraped."""
        self.queue.set_function(lambda: engine.queue_depth)
        self.running.set_function(lambda: engine.running)
        self.sessions.set_function(lambda: len(engine.sessions))
        per = engine.bytes_per_session
        self.session_bytes.set_function(lambda: len(engine.sessions) * per if per is not None else float("nan"))

    def tally(self) -> TokenTally:
        return TokenTally(self.generated_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class TokenTally:
    """One request's generated tokens. `token()` is called by the engine (its thread) for every token it makes;
    `end(reason)` by the HTTP side once it knows how the request ended. The tokens counted until then go to that
    reason's series, and so does any the engine still makes afterwards (a cancelled stream's last step runs before
    the engine sees the cancel): every token is counted once, whether or not its client read it."""

    def __init__(self, counter: Counter):
        self._counter = counter
        self._lock = threading.Lock()
        self._count = 0
        self._reason: str | None = None

    def token(self):
        with self._lock:
            if self._reason is None:
                self._count += 1
                return
            reason = self._reason
        self._counter.labels(finish_reason=reason).inc()

    def end(self, reason: str):
        """The first call decides the reason; later calls change nothing."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}")
        with self._lock:
            if self._reason is not None:
                return
            self._reason, count = reason, self._count
        self._counter.labels(finish_reason=reason).inc(count)


def endpoint_label(routes, scope) -> str:
    """The template of the route this request's path matches (a wrong method still names the route), or
    UNMATCHED."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return getattr(route, "path", UNMATCHED)
    return UNMATCHED
