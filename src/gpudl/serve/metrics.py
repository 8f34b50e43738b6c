"""What the server says about itself at /metrics, in Prometheus's text format (prometheus-client),
shaped as vLLM's series so that a vLLM dashboard works on gpudl by replacing the prefix `vllm:`
with `gpudl:`: the same names after the prefix, the `model_name` label, the same types, units and
bucket boundaries (gpudl adds finer ones below vLLM's smallest, which no query of vLLM's can miss).
Two series are gpudl's own, with no vLLM counterpart: requests refused at the door and requests
cancelled (their caller left, or their deadline passed in the queue); and `gpudl:batch_size`.

Where each number comes from, and why there:
- at scrape time, from the engine itself: requests running and waiting, the KV cache's use, and
  the engine's own counters (`engine.Stats`: generated tokens, refusals, expiries, cancellations),
  so that the hot loop pays nothing and the numbers are the engine's, counted where it decides;
- a GPT request's times and tokens, on the event loop, as its items reach the caller (`Tracked`):
  time to first token and between tokens as the caller sees them, as vLLM measures in its frontend;
- from the worker thread through the engine's hooks: queue time (when the model takes a request),
  batch sizes, and a classifier's end-to-end latency (when the worker answers it).

A registry of its own per server (not the process-wide default), so that two servers in one
process, as in the tests, do not share counters.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "gpudl:"
# vLLM's boundaries (vllm/v1/metrics/loggers.py), with finer ones below its smallest: a classifier
# answers in milliseconds and a GPU makes a token every few, where vLLM's first bucket is 0.3 s / 10 ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005) + (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                              2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25) + (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's; abort: the caller left before the answer ended


def buckets_1_2_5(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `most`: vLLM's buckets for token counts (up to the context length).

    >>> buckets_1_2_5(100)
    (1, 2, 5, 10, 20, 50, 100)
    """
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Metrics:
    """The series of one served model. `engine`: a BatchingEngine or a GenerationEngine (a GPT: it
    has `kv_cache_usage`), whose hooks this sets; call before the engine starts."""

    def __init__(self, model_name: str, engine):
        self.registry = r = CollectorRegistry()
        self.generates = hasattr(engine, "kv_cache_usage")
        r.register(_EngineState(model_name, engine, self.generates))

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               REQUEST_BUCKETS)
        self.batch_size = histogram("batch_size", "gpudl: rows (classifiers) or sequences (GPT) per model call",
                                    BATCH_BUCKETS)
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=r)
        # All reasons exist from the start, at 0, as in vLLM; a classifier's answer ends as "stop".
        self.success = {k: success.labels(model_name, k) for k in (FINISH_REASONS if self.generates else ("stop",))}
        engine.observe_batch = self.batch_size.observe
        engine.observe_queue = self.queue.observe
        if self.generates:
            self._generation_series(histogram, engine.cfg.block_size, model_name)
            engine.observe_stream = lambda items: Tracked(self, items)
        else:
            engine.observe_latency = self._answered

    def _generation_series(self, histogram, context: int, model_name: str) -> None:
        r, tokens = self.registry, buckets_1_2_5(context)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        gaps = Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                         ["model_name"], buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.token_gap = gaps.labels(model_name)
        # vLLM's older name for the same observations, which vLLM itself still emits beside the new one
        r.register(_Renamed(gaps, PREFIX + "time_per_output_token_seconds"))
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.prompt_sizes = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.answer_sizes = histogram("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.max_answer_sizes = histogram("request_max_num_generation_tokens",
                                          "Histogram of maximum number of requested generation tokens.", tokens)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", ["model_name"],
                                     registry=r).labels(model_name)

    def _answered(self, seconds: float) -> None:
        """A classifier's request answered (from the worker thread): `seconds` from arrival to answer."""
        self.e2e.observe(seconds)
        self.success["stop"].inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineState:
    """The series read from the engine when Prometheus scrapes: nothing is paid per request for them."""

    def __init__(self, model_name: str, engine, generates: bool):
        self.labels, self.engine, self.generates = [model_name], engine, generates

    def collect(self):
        engine, stats, labels = self.engine, self.engine.stats, self.labels
        yield _one(GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches.",
                   labels, engine.requests_running())
        yield _one(GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed.",
                   labels, engine.queue_depth())
        if self.generates:  # a classifier keeps no KV cache: the series is absent, not 0
            yield _one(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                       labels, engine.kv_cache_usage())
            yield _one(CounterMetricFamily, "generation_tokens", "Number of generation tokens processed.",
                       labels, stats.tokens)
        yield _one(CounterMetricFamily, "request_refused",
                   "gpudl: requests refused on arrival (the queue was full, or they could not start within --max-wait-s)",
                   labels, stats.rejected)
        cancelled = CounterMetricFamily(PREFIX + "request_cancelled", "gpudl: requests dropped unfinished: their "
                                        "caller left (disconnected) or their deadline passed in the queue (deadline)",
                                        labels=["model_name", "reason"])
        cancelled.add_metric(labels + ["disconnected"], stats.cancelled)
        cancelled.add_metric(labels + ["deadline"], stats.expired)
        yield cancelled


def _one(family, name: str, doc: str, labels: list[str], value: float) -> Metric:
    metric = family(PREFIX + name, doc, labels=["model_name"])
    metric.add_metric(labels, value)
    return metric


class _Renamed:
    """Another collector's series under a second name: one observation, two names, no double cost."""

    def __init__(self, source, alias: str):
        self.source, self.alias = source, alias

    def collect(self):
        for family in self.source.collect():
            renamed = Metric(self.alias, family.documentation, family.type)
            for s in family.samples:  # name_bucket, name_count, ...: the suffix stays
                renamed.add_sample(self.alias + s.name[len(family.name):], s.labels, s.value, s.timestamp, s.exemplar)
            yield renamed


class Tracked:
    """A GPT request's items (`GenerationEngine.stream`) on their way to the caller, timed and counted
    as they pass: what `stream` returns when metrics are on. Closing it early, or leaving it to the
    garbage collector unfinished, counts the request as aborted (its caller left) and cancels it."""

    def __init__(self, metrics: Metrics, items):
        self.metrics, self.items, self.request = metrics, items, items.request
        self.first: float | None = None   # when the first token reached the caller
        self.last: float | None = None
        self.generated = 0
        self.ended = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            item = await self.items.__anext__()
        except asyncio.CancelledError:
            self.close()  # the caller's task was cancelled: a client that disconnected
            raise
        except BaseException:
            self.ended = True  # the end, or an error the engine counted (deadline, stopping, a failed model)
            raise
        now = time.monotonic()
        if item.token is not None:
            self._token(now)
        if item.finish is not None:
            self._finish(item.finish, now)
        return item

    def _token(self, now: float) -> None:
        m = self.metrics
        if self.first is None:
            self.first = now
            m.ttft.observe(now - self.request.arrived)
            m.prompt_tokens.inc(len(self.request.prompt))  # prefilled: the first token is the prefill's
        else:
            m.token_gap.observe(now - self.last)
        self.last = now
        self.generated += 1

    def _finish(self, reason: str, now: float) -> None:
        m, started = self.metrics, self.request.started
        self.ended = True
        m.success[reason].inc()
        m.e2e.observe(now - self.request.arrived)
        m.prefill.observe(self.first - started)
        m.decode.observe(now - self.first)
        m.inference.observe(now - started)
        m.prompt_sizes.observe(len(self.request.prompt))
        m.answer_sizes.observe(self.generated)
        m.max_answer_sizes.observe(self.generated)  # n is always 1 here: the one sequence's tokens

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.metrics.success["abort"].inc()
        self.items.close()

    async def aclose(self) -> None:
        self.close()

    def __del__(self):
        self.close()
