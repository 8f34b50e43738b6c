"""What the server says about itself at /metrics, in Prometheus's text format (prometheus-client).

A registry of its own per server (not the process-wide default), so that two servers in one
process, as in the tests, do not share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self, queue_depth):
        """`queue_depth`: a function that returns the requests waiting now."""
        self.registry = r = CollectorRegistry()
        self.queue = Gauge("gpudl_queue_depth", "requests waiting for the model", registry=r)
        self.queue.set_function(queue_depth)
        self.batch_size = Histogram("gpudl_batch_size", "rows (classifiers) or sequences (GPT) per model call",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.latency = Histogram("gpudl_request_latency_seconds", "request latency, from arrival to the last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("gpudl_time_to_first_token_seconds", "GPT: arrival to the first token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("gpudl_requests", "requests answered", ["endpoint", "status"], registry=r)
        self.tokens = Counter("gpudl_generated_tokens", "tokens generated (rate() gives tokens/s)", registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
