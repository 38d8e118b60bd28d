"""The server's Prometheus metrics (prometheus_client), in a registry of its own so several apps in one process
(tests) do not collide. Served at GET /metrics in the text exposition format."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("txl_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("txl_prompt_tokens", "Prompt tokens fed", registry=r)
        self.generated_tokens = Counter("txl_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("txl_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("txl_inter_token_latency_seconds", "Between two tokens of one stream",
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

    def text(self) -> bytes:
        return generate_latest(self.registry)
