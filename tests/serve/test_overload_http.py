"""Overload over HTTP: `gpudl serve`'s app (the routes behind the key guard) on loopback under
uvicorn, in a thread of this process around an engine the test holds, asked by httpx and by raw
sockets that hang up. A refusal is 429 with Retry-After in each protocol's error shape; a client
that disconnects while its request waits (plain or streamed) takes it out of the queue before the
model sees it; X-Tenant and `priority` reach the scheduler. The model records each prompt it
prefills, so what ran is read from the model itself."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import socket
import threading
import time

import httpx
import pytest

from gpudl.serve.guard import client_of
from gpudl.serve.oip import ProtocolError, TensorSpec, parse_infer_request
from gpudl.serve.openai_api import parse_completion
from test_admission import gpt_recording_prompts
from test_engine import Gate

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

WAIT_S = 30  # how long a test waits for something that should happen at once, before it fails


def _until(condition, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


class Live:
    """The app around `engine` on a free loopback port, in a uvicorn thread of this process."""

    def __init__(self, loaded, engine):
        from gpudl.serve.app import Served, create_app
        from gpudl.serve.guard import Guard

        served = Served(name=loaded.name, loaded=loaded, engine=engine)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(Guard(create_app(served), None, served.max_body_bytes), host="127.0.0.1",
                                port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _until(lambda: self.server.started, "the server started")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)


@pytest.fixture
def served(tmp_path):
    """(server, engine, prompts the model prefilled, gate holding the worker after step 1)."""
    from gpudl.checkpoint import export_safetensors
    from gpudl.serve.generation import GenerationEngine
    from gpudl.serve.load import load_model

    model, _ = gpt_recording_prompts()
    meta = {"gpudl_model": "gpt-tiny", "config": json.dumps(dataclasses.asdict(model.cfg))}
    export_safetensors(model, tmp_path / "model.safetensors", meta)
    loaded = load_model(tmp_path, device="cpu")
    prompts = []
    prefill = loaded.model.prefill

    def recording(ids, cache, slot):  # the served model records each prompt it prefills, then runs it
        prompts.extend(bytes(row.tolist()) for row in ids)
        return prefill(ids, cache, slot)
    loaded.model.prefill = recording
    engine = GenerationEngine(loaded.model, "cpu", tokenizer=loaded.tokenizer, max_batch_size=1, max_wait_s=5.0)
    gate = Gate(1)
    engine.observe_batch = gate
    engine.start()
    live = Live(loaded, engine)
    yield live, engine, prompts, gate
    gate.release(1)
    live.close()
    import asyncio

    asyncio.run(engine.stop(timeout_s=WAIT_S))


def completion(prompt: str, **fields) -> dict:
    return {"model": "gpt-tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}


def hold(live: Live, engine, gate, pool) -> concurrent.futures.Future:
    """A request that takes the one decode slot; returns once the worker is held after its first step."""
    running = pool.submit(httpx.post, live.url + "/v1/completions", json=completion("running0", max_tokens=8),
                          timeout=WAIT_S)
    assert gate.reached[1].wait(WAIT_S)
    return running


def queue_one(live: Live, engine, pool, body: dict, **kw) -> concurrent.futures.Future:
    """Send a request and return once the engine has queued it."""
    depth = engine.queue_depth()
    sent = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=WAIT_S, **kw)
    _until(lambda: engine.queue_depth() == depth + 1, "the request was queued")
    return sent


def test_a_refusal_is_429_with_retry_after_in_both_protocols_and_load_that_drops_is_served(served):
    live, engine, prompts, gate = served
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = hold(live, engine, gate, pool)
        waiting = queue_one(live, engine, pool, completion("waiting0"))  # a cold start: one batch (1) may wait
        refused = httpx.post(live.url + "/v1/completions", json=completion("refused0"), timeout=WAIT_S)
        oip = httpx.post(live.url + "/v2/models/gpt-tiny/infer", timeout=WAIT_S, json={
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["refused1"]}]})
        gate.release(1)
        assert running.result().status_code == 200 and waiting.result().status_code == 200
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded") and "capacity" in error["message"]
    assert oip.status_code == 429 and oip.headers["retry-after"] == "1" and list(oip.json()) == ["error"]
    again = httpx.post(live.url + "/v1/completions", json=completion("again000"), timeout=WAIT_S)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    assert prompts == [b"running0", b"waiting0", b"again000"] and engine.stats.rejected == 2


def _hang_up_after_sending(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def test_clients_that_disconnect_while_queued_leave_the_queue_unrun(served):
    live, engine, prompts, gate = served
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = hold(live, engine, gate, pool)
        engine.max_wait_s = None  # room for both in the queue (admission is another test's subject)
        plain = _hang_up_after_sending(live.port, completion("plain000"))
        _until(lambda: engine.queue_depth() == 1, "the plain request was queued")
        streamed = _hang_up_after_sending(live.port, completion("stream00", stream=True))
        _until(lambda: engine.queue_depth() == 2, "the streamed request was queued")
        plain.close()
        streamed.close()
        _until(lambda: engine.queue_depth() == 0, "both left the queue")  # while the model is still held
        assert engine.stats.cancelled == 2
        gate.release(1)
        assert running.result().status_code == 200
    after = httpx.post(live.url + "/v1/completions", json=completion("after000"), timeout=WAIT_S)
    assert after.status_code == 200
    assert prompts == [b"running0", b"after000"]  # the two that hung up never reached the model


def test_tenants_share_the_slots_and_priority_orders_a_tenants_own(served):
    live, engine, prompts, gate = served
    engine.max_wait_s = None
    heavy = {"X-Tenant": "heavy"}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        running = hold(live, engine, gate, pool)
        sent = [queue_one(live, engine, pool, completion(p, priority=k), headers=heavy)
                for p, k in (("heavy-h1", 0), ("heavy-h2", 0), ("heavy-h3", -1))]
        sent.append(queue_one(live, engine, pool, completion("light-l1"), headers={"X-Tenant": "light"}))
        gate.release(1)
        assert [f.result().status_code for f in [running, *sent]] == [200] * 5
    # the running request was anonymous, heavy its own tenant: light, lifted to heavy's share, goes first
    # after one of heavy's; heavy's -1 before its 0s.
    assert prompts[0] == b"running0" and prompts[1:] == [b"heavy-h3", b"light-l1", b"heavy-h1", b"heavy-h2"]


def test_client_names_hash_the_key_and_name_the_tenant():
    salt = b"s" * 16
    a = client_of({"authorization": "Bearer key-a"}, salt)
    assert a == client_of({"x-api-key": "key-a"}, salt) != client_of({"authorization": "Bearer key-b"}, salt)
    assert "key-a" not in a and a != client_of({"authorization": "Bearer key-a"}, b"t" * 16)
    assert client_of({}, salt) == "anonymous"
    assert client_of({"authorization": "Bearer key-a", "x-tenant": "acme"}, salt) == a + "/acme"
    with pytest.raises(ProtocolError) as e:
        client_of({"x-tenant": "x" * 65}, salt)
    assert e.value.status == 400 and "X-Tenant" in e.value.message


def test_priority_is_parsed_from_both_protocols_and_a_bad_one_names_the_field():
    assert parse_completion(b'{"prompt": "Hi", "priority": -3}', 64, "gpt").priority == -3
    assert parse_completion(b'{"prompt": "Hi"}', 64, "gpt").priority == 0
    with pytest.raises(ProtocolError) as e:
        parse_completion(b'{"prompt": "Hi", "priority": "high"}', 64, "gpt")
    assert e.value.param == "priority"
    spec = {"x": TensorSpec("x", "INT64", (-1,))}
    body = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [1]}], "parameters": %s}'
    assert parse_infer_request(body % b'{"priority": 2}', None, spec, max_body_bytes=2**20).priority == 2
    with pytest.raises(ProtocolError) as e:
        parse_infer_request(body % b'{"priority": 1.5}', None, spec, max_body_bytes=2**20)
    assert "parameters.priority" in e.value.message
