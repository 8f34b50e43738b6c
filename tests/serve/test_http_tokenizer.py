"""`gpudl serve` of a run trained on BPE tokens (bpe_run.py), in a real process on loopback, asked by
the openai client and httpx: prompts are encoded and answers decoded with the run's tokenizer.json,
usage counts its tokens, stop texts and characters that span tokens come out as the text the
tokenizers library decodes from a greedy loop of this file's own."""

from __future__ import annotations

import json

import httpx
import pytest

from bpe_run import BLOCK, SENTENCE, bpe_run, greedy_ids, hf_tokenizer, split_characters

pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
from test_http import Server  # noqa: E402  the serving tests' own server process

PROMPT = "Grüße"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return bpe_run(tmp_path_factory.getbasetemp() / "bpe")


@pytest.fixture(scope="module")
def hf():
    return hf_tokenizer()


@pytest.fixture(scope="module")
def server(run):
    server = Server(run, "--max-batch-size", "4")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completions_decode_with_the_runs_tokenizer_and_usage_counts_its_tokens(run, hf, client):
    prompt_ids = hf.encode(PROMPT).ids
    longer = greedy_ids(run, prompt_ids, 24)
    n = next(k for k in range(12, 24) if not hf.decode(longer[:k]).endswith("\ufffd"))  # ends on a whole character
    new = longer[:n]
    want = hf.decode(new)
    assert split_characters(hf, new) and "\ufffd" not in want   # characters whose bytes span tokens, all whole
    plain = client.completions.create(model="gpt-tiny", prompt=PROMPT, max_tokens=n, temperature=0)
    assert plain.choices[0].text == want and plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (len(prompt_ids), n)
    chunks = list(client.completions.create(model="gpt-tiny", prompt=PROMPT, max_tokens=n, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want and not any("\ufffd" in t for t in texts)   # each character whole
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt_ids), n)
    chat = client.chat.completions.create(model="gpt-tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=6, temperature=0)
    templated = f"user: {PROMPT}\nassistant:"
    assert chat.usage.prompt_tokens == len(hf.encode(templated).ids) < len(templated.encode())   # tokens, not bytes


@pytest.mark.parametrize("stop, inside", [(" café →", False), ("ne.\n", True)])  # "ne." begins inside "one"
def test_a_stop_across_tokens_ends_the_stream_and_the_reply_at_the_same_place(run, hf, client, stop, inside):
    new = greedy_ids(run, hf.encode(PROMPT).ids, 40)
    full = hf.decode(new)
    at = full.find(stop)
    made = next(n for n in range(len(new) + 1) if stop in hf.decode(new[:n]))   # the token completing it
    first = max(k for k in range(made) if len(hf.decode(new[:k])) <= at)          # the token it begins in
    assert at > 0 and made - first >= 2 and (len(hf.decode(new[:first])) < at) == inside
    want = full[:at]
    ask = dict(model="gpt-tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=["never said", stop])
    plain = client.completions.create(**ask)
    assert (plain.choices[0].text, plain.choices[0].finish_reason) == (want, "stop")
    assert plain.usage.completion_tokens == made
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want and not any(stop in t for t in texts)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == made


def test_the_open_inference_protocol_takes_and_gives_text(run, hf, server):
    prompt_ids = hf.encode(PROMPT).ids
    want = hf.decode(greedy_ids(run, prompt_ids, 64))   # 64 new tokens, or until the context is full
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}]}
    answer = httpx.post(server.url + "/v2/models/gpt-tiny/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [want]
    lone = b'{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a\\ud800"]}]}'
    refused = httpx.post(server.url + "/v2/models/gpt-tiny/infer", content=lone, timeout=60)
    assert refused.status_code == 400 and "not UTF-8" in refused.json()["error"]


def test_the_context_is_counted_in_tokens(hf, server):
    long = SENTENCE * 3
    assert len(hf.encode(long).ids) >= BLOCK > len(hf.encode(SENTENCE).ids)
    answer = httpx.post(server.url + "/v1/completions", json={"model": "gpt-tiny", "prompt": long, "max_tokens": 1})
    message = answer.json()["error"]["message"]
    assert answer.status_code == 400 and f"{len(hf.encode(long).ids)} tokens, which leaves no room" in message
    fits = len(hf.encode(SENTENCE).ids)
    answer = httpx.post(server.url + "/v1/completions", content=json.dumps(
        {"model": "gpt-tiny", "prompt": SENTENCE, "max_tokens": BLOCK - fits + 1}))
    assert answer.status_code == 400 and f"at most {BLOCK - fits}" in answer.json()["error"]["message"]
    huge = httpx.post(server.url + "/v1/completions", json={"model": "gpt-tiny", "prompt": "x" * 2**20}, timeout=60)
    assert huge.status_code == 400 and "more than this model's context" in huge.json()["error"]["message"]
