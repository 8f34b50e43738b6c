"""/metrics as operators read it: vLLM's series under gpudl's prefix (the same names after it, types,
`model_name` label and bucket boundaries), scraped from a real `gpudl serve` on loopback while real
clients load it, and checked against what those clients saw: answers and their finish reasons,
tokens, refusals (429/503), a stream its client left, a deadline that passed in the queue."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TINY
from test_http import Server, _trained, resnet_run  # noqa: F401  resnet_run: the fixture

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

# vLLM's series (vllm/v1/metrics/loggers.py) and their types: a vLLM dashboard's queries, prefix replaced
VLLM_GPT = {"num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
            "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
            "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
            "time_per_output_token_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
            "request_queue_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
            "request_decode_time_seconds": "histogram", "request_inference_time_seconds": "histogram",
            "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
            "request_max_num_generation_tokens": "histogram"}
VLLM_CLASSIFIER = ("num_requests_running", "num_requests_waiting", "request_success", "e2e_request_latency_seconds",
                   "request_queue_time_seconds")
# vLLM's bucket boundaries: every `le` a vLLM query or alert names must exist here too
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_TOKEN_GAP = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                  80.0]
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]


class Scrape:
    """One /metrics answer, parsed by prometheus_client's own parser."""

    def __init__(self, url: str):
        answer = httpx.get(url + "/metrics", timeout=30)
        assert answer.status_code == 200, answer.text
        self.families = {f.name: f for f in text_string_to_metric_families(answer.text)}

    def __call__(self, name: str, **labels) -> float:
        """The sum of the samples called `name` whose labels include `labels`."""
        found = [s.value for f in self.families.values() for s in f.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        assert found, f"{name} {labels or ''} is not in /metrics"
        return sum(found)

    def buckets(self, name: str) -> list[float]:
        return [float(s.labels["le"]) for s in self.families[name].samples if s.name == name + "_bucket"]


def _check_shapes(scrape: Scrape, series, model: str) -> None:
    for name in series:
        family = scrape.families.get("gpudl:" + name)
        assert family is not None, f"gpudl:{name} is missing"
        if isinstance(series, dict):
            assert family.type == series[name], (name, family.type)
    for family in scrape.families.values():
        if family.name.startswith("gpudl:"):
            assert all(s.labels.get("model_name") == model for s in family.samples), family.name


def _ask(client, i: int, stop: str) -> dict:
    """Request i of the load: completions and chat, plain and streamed in turn, of 20 to 110 tokens; every
    third a greedy completion of "def " that ends at `stop`, a text the model makes from "def "."""
    chat, stream, max_tokens = i % 2 == 1, i % 4 >= 2, 20 + 10 * (i % 10)
    create = client.chat.completions.create if chat else client.completions.create
    prompt = dict(messages=[{"role": "user", "content": f"q{i}"}]) if chat else dict(prompt=f"x = {i}\n")
    if i % 3 == 0 and not chat:
        prompt = dict(prompt="def ", stop=[stop])
    start = time.monotonic()
    if stream:
        finish = usage = None
        for chunk in create(model="gpt-tiny", max_tokens=max_tokens, temperature=0, stream=True,
                            stream_options={"include_usage": True}, **prompt):
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            usage = chunk.usage or usage
    else:
        answer = create(model="gpt-tiny", max_tokens=max_tokens, temperature=0, **prompt)
        finish, usage = answer.choices[0].finish_reason, answer.usage
    return dict(finish=finish, prompt=usage.prompt_tokens, tokens=usage.completion_tokens,
                seconds=time.monotonic() - start)


def _watch(url: str, done: threading.Event, seen: list) -> None:
    """Scrape until `done`: (running, waiting, KV-cache use) each time."""
    while not done.is_set():
        s = Scrape(url)
        seen.append((s("gpudl:num_requests_running"), s("gpudl:num_requests_waiting"),
                     s("gpudl:kv_cache_usage_perc")))


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A context of 512 bytes: a 400-token answer takes a good part of a second on the CPU."""
    return _trained(tmp_path_factory.mktemp("long"), *TINY, "model.block_size=512", "model.d_model=64")


def test_concurrent_clients_are_counted_as_they_saw_it(long_run):
    server = Server(long_run, "--max-batch-size", "4")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    clients, done, seen = 6, threading.Event(), []
    try:
        # the load's first request: what greedy decoding makes of "def ", so that some answers stop at it
        start = time.monotonic()
        probe = client.completions.create(model="gpt-tiny", prompt="def ", max_tokens=8, temperature=0)
        answers = [dict(finish=probe.choices[0].finish_reason, prompt=probe.usage.prompt_tokens,
                        tokens=probe.usage.completion_tokens, seconds=time.monotonic() - start)]
        stop = next(c for c in probe.choices[0].text if c.isprintable() and c != "\ufffd")
        watcher = threading.Thread(target=_watch, args=(server.url, done, seen))
        watcher.start()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            answers += pool.map(lambda i: _ask(client, i, stop), range(24))
        done.set()
        watcher.join()
        s = Scrape(server.url)
    finally:
        done.set()
        server.stop()
    _check_shapes(s, VLLM_GPT, "gpt-tiny")
    n, tokens = len(answers), sum(a["tokens"] for a in answers)
    for reason in ("stop", "length"):
        assert s("gpudl:request_success_total", finished_reason=reason) == sum(a["finish"] == reason for a in answers)
    assert s("gpudl:request_success_total", finished_reason="abort") == 0
    assert s("gpudl:generation_tokens_total") == tokens
    assert s("gpudl:prompt_tokens_total") == s("gpudl:request_prompt_tokens_sum") == sum(a["prompt"] for a in answers)
    assert s("gpudl:request_generation_tokens_sum") == tokens
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds"):
        assert s(f"gpudl:{name}_count") == n, name  # every request, streamed or not, as vLLM counts them
    # a token after the first is one gap; the older name carries the same observations
    assert s("gpudl:inter_token_latency_seconds_count") == tokens - n
    for part in ("_count", "_sum"):
        assert s("gpudl:time_per_output_token_seconds" + part) == s("gpudl:inter_token_latency_seconds" + part)
    # the server's times lie inside the clients' own
    assert s("gpudl:time_to_first_token_seconds_sum") < s("gpudl:e2e_request_latency_seconds_sum") \
        < sum(a["seconds"] for a in answers)
    assert set(VLLM_TTFT) <= set(s.buckets("gpudl:time_to_first_token_seconds"))
    assert set(VLLM_TOKEN_GAP) <= set(s.buckets("gpudl:inter_token_latency_seconds"))
    assert set(VLLM_REQUEST) <= set(s.buckets("gpudl:e2e_request_latency_seconds"))
    assert s("gpudl:request_refused_total") == s("gpudl:request_cancelled_total") == 0
    # while they ran: never more running than slots, nor more in the server than clients sending
    assert seen and max(r for r, _, _ in seen) >= 1
    assert all(r <= 4 and r + w <= clients and 0 <= kv <= 1 and (kv * 4).is_integer() for r, w, kv in seen), seen
    assert max(kv for *_, kv in seen) > 0
    assert (s("gpudl:num_requests_running"), s("gpudl:num_requests_waiting"), s("gpudl:kv_cache_usage_perc")) \
        == (0, 0, 0)


def test_refusals_and_a_stream_its_client_left_are_counted(long_run):
    server = Server(long_run, "--max-batch-size", "1", "--max-queue", "1")
    body = {"model": "gpt-tiny", "prompt": "x", "max_tokens": 400, "temperature": 0}
    start = threading.Barrier(6)

    def post(_):
        start.wait()  # all at once: one runs, one waits, the others find the queue full
        return httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            statuses = list(pool.map(post, range(6)))
        s = Scrape(server.url)
        refused = sum(code in (429, 503) for code in statuses)
        assert refused >= 1 and sum(code == 200 for code in statuses) + refused == 6, statuses
        assert s("gpudl:request_refused_total") == refused
        assert s("gpudl:request_success_total") == s("gpudl:e2e_request_latency_seconds_count") == 6 - refused
        assert s("gpudl:request_cancelled_total") == 0
        _leave_mid_stream(server.url)
        s = _scrape_until(server.url, lambda s: s("gpudl:request_cancelled_total", reason="disconnected") == 1)
        assert s("gpudl:request_success_total", finished_reason="abort") == 1
        assert s("gpudl:request_success_total") == 6 - refused + 1  # and no stop or length for it
        assert s("gpudl:request_cancelled_total", reason="deadline") == 0
        assert s("gpudl:num_requests_running") == s("gpudl:kv_cache_usage_perc") == 0
    finally:
        server.stop()


def _leave_mid_stream(url: str) -> None:
    events = 0
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": "gpt-tiny", "prompt": "x", "max_tokens": 400, "temperature": 0,
                            "stream": True}) as answer:
        for line in answer.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection: most of the 400 tokens were still to come
    assert events == 3


def _scrape_until(url: str, ok, timeout: float = 30.0) -> Scrape:
    """The engine notices a client that left at its next step: scrape until it has."""
    end = time.monotonic() + timeout
    while True:
        s = Scrape(url)
        if ok(s) or time.monotonic() > end:
            return s
        time.sleep(0.05)


def test_a_classifiers_series_refusal_and_deadline(resnet_run):
    # a batch closes when full (2 rows) or 1.5 s after its first request: past a 1-row request's deadline
    server = Server(resnet_run, "--max-batch-size", "2", "--max-queue", "1", "--max-queue-delay-ms", "1500",
                    "--request-timeout-s", "0.5")
    url = server.url + "/v2/models/resnet18/infer"

    def body(rows: int) -> dict:
        data = np.zeros(rows * 768).tolist()
        return {"inputs": [{"name": "input", "shape": [rows, 3, 16, 16], "datatype": "FP32", "data": data}]}
    try:
        assert httpx.post(url, json=body(2), timeout=30).status_code == 200  # a full batch runs at once
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            late = pool.submit(httpx.post, url, json=body(1), timeout=30)
            time.sleep(0.2)  # while it waits in the queue: the queue is full
            assert httpx.post(url, json=body(1), timeout=30).status_code in (429, 503)
            assert late.result().status_code == 504
        s = Scrape(server.url)
    finally:
        server.stop()
    _check_shapes(s, VLLM_CLASSIFIER, "resnet18")
    assert not {"gpudl:kv_cache_usage_perc", "gpudl:time_to_first_token_seconds", "gpudl:generation_tokens"} \
        & set(s.families)  # a classifier has no KV cache and no tokens: the series are absent, not 0
    assert s("gpudl:request_success_total") == s("gpudl:request_success_total", finished_reason="stop") == 1
    assert s("gpudl:e2e_request_latency_seconds_count") == s("gpudl:request_queue_time_seconds_count") == 1
    assert (s("gpudl:batch_size_count"), s("gpudl:batch_size_sum")) == (1, 2)
    assert s("gpudl:request_refused_total") == 1
    assert s("gpudl:request_cancelled_total", reason="deadline") == 1
    assert s("gpudl:request_cancelled_total", reason="disconnected") == 0
    assert s("gpudl:num_requests_running") == s("gpudl:num_requests_waiting") == 0
