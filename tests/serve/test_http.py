"""`gpudl serve` as users meet it: train -> export -> serve in a real process on loopback, asked by
real clients (tritonclient.http, the openai package, httpx). Each answer is checked against the
model run here, from the same exported weights, without the server."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from conftest import TINY, run_cli, run_here

pytest.importorskip("fastapi")
tritonclient_http = pytest.importorskip("tritonclient.http")
openai = pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`gpudl serve MODEL ARGS` in its own process, ready when /v2/health/ready says so."""

    def __init__(self, model: Path, *args: str, env: dict | None = None, verify: ssl.SSLContext | bool = True):
        self.port = _free_port()
        self.url = f"{'https' if '--ssl-certfile' in args else 'http'}://127.0.0.1:{self.port}"
        self.verify = verify  # over TLS: the context that trusts the server's CA (and holds a client certificate)
        # On the CPU on any machine: the answers are compared with a model loaded on the CPU here.
        self.proc = subprocess.Popen([sys.executable, "-m", "gpudl", "serve", str(model), "--port", str(self.port),
                                      "--device", "cpu", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})})
        key = dict(zip(args, args[1:])).get("--api-key")
        self._wait_ready(headers={"Authorization": f"Bearer {key}"} if key else {})

    def _wait_ready(self, headers: dict, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/v2/health/ready", headers=headers, timeout=2,
                             verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError("the server did not become ready")

    def stop(self, timeout: float = 60.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out


def _trained(tmp: Path, *sets: str) -> Path:
    """A run trained and exported by `gpudl train` and `gpudl export`, in this process: what is served (in a
    process of its own) is the subject here, not these commands' processes (tests/unit/test_cli.py)."""
    runs = tmp / "runs"
    done = run_here("train", *[f"--set={s}" for s in sets], f"--set=run.dir={runs}", "--set=train.max_steps=2",
                    "--set=checkpoint.every=2", "--device=cpu")
    assert done.returncode == 0, done.stderr
    run = next(runs.iterdir())
    exported = run_here("export", str(run))
    assert exported.returncode == 0, exported.stderr
    return run


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory.mktemp("gpt"), *TINY)


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory.mktemp("resnet"), "model.name=resnet18", "data.kind=images",
                    "data.image_size=16", "train.batch_size=4", "train.precision=fp32", "log.progress=false",
                    "train.eval_every=0", "train.time_budget_s=0")


@pytest.fixture(scope="module")
def gpt_server(gpt_run):
    server = Server(gpt_run, "--max-batch-size", "8")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def resnet_server(resnet_run):
    server = Server(resnet_run, "--max-batch-size", "8", "--max-queue-delay-ms", "200")
    yield server
    server.stop()


def _local(run: Path):
    """The exported model, here, without the server: the reference."""
    from gpudl.serve.load import load_model

    return load_model(str(run), device="cpu", precision="fp32")


def _reference(run: Path):
    """The run's model from its checkpoint (not the export the server reads), in eval mode on the CPU."""
    from gpudl.run.trained import load_trained

    return load_trained(run, "cpu").model


def _greedy(model, prompt: bytes, n: int) -> bytes:
    """Greedy continuation without a cache: the whole sequence through the model at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return bytes(ids[len(prompt):])


def _metric(url: str, name: str) -> float:
    """The sum of the samples called `name` in /metrics (of every label set: one model, one value)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = [s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in f.samples
             if s.name == name]
    assert found, f"{name} not in /metrics"
    return sum(found)


def test_triton_clients_queued_together_run_as_one_batch_with_their_own_answers(resnet_server, resnet_run):
    model, client = _reference(resnet_run), tritonclient_http.InferenceServerClient(resnet_server.url[7:],
                                                                                     concurrency=4)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("resnet18")
    meta = client.get_model_metadata("resnet18")
    assert meta["inputs"][0]["shape"] == [-1, 3, 16, 16] and meta["inputs"][0]["datatype"] == "FP32"
    xs = [np.random.default_rng(i).standard_normal((rows, 3, 16, 16), dtype=np.float32) for i, rows in
          enumerate((1, 2, 1, 3))]
    calls, rows = _metric(resnet_server.url, "gpudl:batch_size_count"), _metric(resnet_server.url,
                                                                                  "gpudl:batch_size_sum")
    pending = []
    for i, x in enumerate(xs):  # JSON and binary tensors, side by side
        given = tritonclient_http.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=i % 2 == 1)
        asked = tritonclient_http.InferRequestedOutput("logits", binary_data=i % 2 == 0)
        pending.append(client.async_infer("resnet18", [given], outputs=[asked]))
    answers = [p.get_result().as_numpy("logits") for p in pending]
    assert _metric(resnet_server.url, "gpudl:batch_size_count") == calls + 1  # one forward for the four
    assert _metric(resnet_server.url, "gpudl:batch_size_sum") == rows + 7
    with torch.no_grad():
        for x, got in zip(xs, answers):
            want = model(torch.from_numpy(x)).numpy()
            # within 1e-5 of the largest logit, not bit for bit: oneDNN blocks a convolution by its batch size
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_the_openai_client_gets_the_models_own_greedy_text_plain_and_streamed(gpt_server, gpt_run):
    client = openai.OpenAI(base_url=gpt_server.url + "/v1", api_key="unused")
    want = _greedy(_reference(gpt_run), b"def ", 12).decode("utf-8", errors="replace")
    plain = client.completions.create(model="gpt-tiny", prompt="def ", max_tokens=12, temperature=0)
    assert plain.choices[0].text == want and plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (4, 12)
    streamed = client.completions.create(model="gpt-tiny", prompt="def ", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    chat = client.chat.completions.create(model="gpt-tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
    pieces = client.chat.completions.create(model="gpt-tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == chat.choices[0].message.content
    assert [m.id for m in client.models.list()] == ["gpt-tiny"]


def test_concurrent_streams_of_different_lengths_each_get_their_greedy_text(gpt_server, gpt_run):
    model, client = _reference(gpt_run), openai.OpenAI(base_url=gpt_server.url + "/v1", api_key="unused")
    asks = [(f"x = {i}\n", 4 + 3 * i) for i in range(6)]  # join and leave the running batch at different steps

    def ask(prompt_and_tokens):
        prompt, n = prompt_and_tokens
        return client.completions.create(model="gpt-tiny", prompt=prompt, max_tokens=n, temperature=0).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, asks))
    for (prompt, n), text in zip(asks, got):
        assert text == _greedy(model, prompt.encode(), n).decode("utf-8", errors="replace")


@pytest.mark.parametrize("path, body, status, field", [
    ("/v2/models/resnet18/infer", b"{not json", 400, "JSON"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "pixels", "shape": [1], "datatype": "FP32", "data": [1]}]}',
     400, "pixels"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP33", '
                                  b'"data": [1]}]}', 400, "datatype"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "input", "shape": [1, 3, 8, 8], "datatype": "FP32", '
                                  b'"data": [' + b",".join([b"0"] * 192) + b"]}]}", 400, "shape"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "input", "shape": [9, 3, 16, 16], "datatype": "FP32", '
                                  b'"data": [' + b",".join([b"0"] * 6912) + b"]}]}", 400, "8"),
    ("/v2/models/nope/infer", b"{}", 404, "nope"),
])
def test_bad_oip_requests_get_their_status_and_name_the_field(resnet_server, path, body, status, field):
    answer = httpx.post(resnet_server.url + path, content=body)
    assert answer.status_code == status and field in answer.json()["error"]


@pytest.mark.parametrize("body, status, field", [
    (b"[", 400, ""),
    (b'{"model": "gpt-tiny", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "gpt-tiny", "prompt": "' + b"x" * 200 + b'", "max_tokens": 4}', 400, "prompt"),
    (b'{"model": "gpt-tiny", "prompt": 3}', 400, "prompt"),
    (b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
])
def test_bad_openai_requests_get_their_status(gpt_server, body, status, field):
    answer = httpx.post(gpt_server.url + "/v1/completions", content=body)
    assert answer.status_code == status and field in answer.json()["error"]["message"]


def test_a_body_over_the_limit_is_413_and_fuzzed_bodies_never_a_500(resnet_server):
    assert httpx.post(resnet_server.url + "/v2/models/resnet18/infer", content=b"0" * (64 * 2**20 + 1)).status_code \
        == 413
    rss = _rss_kib(resnet_server.proc.pid)
    rng = np.random.default_rng(0)
    for i in range(300):
        body = rng.integers(0, 256, int(rng.integers(0, 2000)), dtype=np.uint8).tobytes()
        if i % 2:
            body = b'{"inputs": [{"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": ' + body
        assert 400 <= httpx.post(resnet_server.url + "/v2/models/resnet18/infer", content=body).status_code < 500
    assert _rss_kib(resnet_server.proc.pid) - rss < 50 * 1024  # malformed requests leave nothing behind


def _rss_kib(pid: int) -> int:
    return int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS")).split()[1])


def test_a_full_queue_is_429_and_a_request_late_in_the_queue_504(resnet_run):
    server = Server(resnet_run, "--max-queue", "1", "--max-queue-delay-ms", "1500", "--request-timeout-s", "0.5")
    try:
        body = {"inputs": [{"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": [0.0] * 768}]}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, server.url + "/v2/models/resnet18/infer", json=body, timeout=30)
            time.sleep(0.3)  # the first waits for its batch to fill (1.5 s), past its deadline (0.5 s)
            second = httpx.post(server.url + "/v2/models/resnet18/infer", json=body, timeout=30)
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert first.result().status_code == 504
    finally:
        server.stop()


def test_other_machines_need_the_api_key(gpt_run):
    refused = run_cli("serve", str(gpt_run), "--host", "0.0.0.0", "--port", str(_free_port()), timeout=60)
    assert refused.returncode == 2 and "--api-key" in refused.stderr and len(refused.stderr.splitlines()) == 1
    server = Server(gpt_run, "--api-key", "s3cret")
    try:
        assert httpx.get(server.url + "/v2/health/live").status_code == 401
        assert httpx.get(server.url + "/v2/health/live", headers={"X-API-Key": "wrong"}).status_code == 401
        assert httpx.get(server.url + "/v2/health/live", headers={"X-API-Key": "s3cret"}).status_code == 200
        text = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret").completions.create(
            model="gpt-tiny", prompt="a", max_tokens=2, temperature=0).choices[0].text
        assert len(text.encode("utf-8", errors="surrogatepass")) >= 1
    finally:
        server.stop()


def test_sigterm_finishes_the_stream_in_flight_then_exits(tmp_path):
    # a context of 512 bytes: a stream of 400 tokens takes a good part of a second, so most of it is
    # still to come when the signal arrives
    run = _trained(tmp_path, *TINY, "model.block_size=512", "model.d_model=64")
    server = Server(run)
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "gpt-tiny", "prompt": "def ", "max_tokens": 400, "temperature": 0,
                            "stream": True}) as answer:
        for line in answer.iter_lines():
            if not lines:
                server.proc.send_signal(signal.SIGTERM)  # after the first event: the rest is still to come
            lines.append(line)
    code = server.proc.wait(timeout=30)  # on its own: no second signal
    events = [line for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], lines[:5]
    assert len(events) > 100  # one per decoded piece of text: all 400 bytes came
    assert code in (0, -signal.SIGTERM)  # uvicorn ends by raising the signal it caught, once it has drained


def test_a_folder_that_is_no_model_is_one_line_and_exit_2(tmp_path):
    done = run_cli("serve", str(tmp_path), "--port", str(_free_port()), timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_while_the_model_loads_only_liveness_answers_200():
    from fastapi.testclient import TestClient

    from gpudl.serve.app import Served, create_app

    client = TestClient(create_app(Served(name="gpt-tiny")))  # what the server answers before loading ends
    assert client.get("/v2/health/live").status_code == 200
    for path in ("/v2/health/ready", "/v2/models/gpt-tiny/ready", "/metrics"):
        assert client.get(path).status_code == 503, path
    assert client.post("/v1/completions", json={"model": "gpt-tiny", "prompt": "x"}).status_code == 503
    assert client.get("/v1/models").json()["data"] == []
