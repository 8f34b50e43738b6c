"""The OpenAI-compatible wire format, checked against the openai package's own types, its SSE decoder
and its whole client (request building, response parsing, streaming, errors): the client's HTTP
transport hands each request to gpudl's parse and encode functions in-process."""

from __future__ import annotations

import json
import random

import pytest

openai = pytest.importorskip("openai")
import httpx2  # noqa: E402  the HTTP library this openai release is built on
from openai._streaming import SSEDecoder  # noqa: E402
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from gpudl.data.tokenizer import ByteTokenizer  # noqa: E402
from gpudl.serve.detok import TextStream  # noqa: E402
from gpudl.serve.oip import ProtocolError  # noqa: E402
from gpudl.serve.openai_api import (  # noqa: E402
    SSE_DONE, CompletionRequest, chat_chunks, chat_response, completion_chunks, completion_response,
    models_list, openai_error, parse_chat, parse_completion)

CONTEXT = 64
MODEL = "gpt-tiny"
ANSWER = "Grüße, 世界 🙂!"   # 1-, 2-, 3- and 4-byte UTF-8 characters: a stream must never split one


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def test_completion_minimal_and_full():
    req = parse_completion(_body(prompt="Hello"), CONTEXT, MODEL)
    assert req == CompletionRequest(prompt="Hello", max_tokens=16, model=MODEL)   # OpenAI's defaults
    full = parse_completion(_body(prompt=["Hi"], max_tokens=10, temperature=0, top_p=0.5, top_k=40, stop="\n",
                                  seed=2**64 - 1, stream=True, stream_options={"include_usage": True}, n=1,
                                  user="u1", presence_penalty=0.0, logprobs=None, echo=False), CONTEXT, MODEL)
    assert full == CompletionRequest(prompt="Hi", max_tokens=10, model=MODEL, temperature=0.0, top_p=0.5, top_k=40,
                                     stop=["\n"], seed=2**64 - 1, stream=True, include_usage=True)
    assert parse_completion(json.dumps({"prompt": "x"}).encode(), CONTEXT, MODEL).model == MODEL  # model optional
    for off in (0, -1):   # vLLM's and others' spelling of "no top-k"
        assert parse_completion(_body(prompt="x", top_k=off), CONTEXT, MODEL).top_k is None
    edge = parse_completion(_body(prompt="x", temperature=2, top_p=1, max_tokens=CONTEXT - 1, stop=["a"] * 4),
                            CONTEXT, MODEL)
    assert (edge.temperature, edge.top_p, edge.max_tokens, len(edge.stop)) == (2.0, 1.0, CONTEXT - 1, 4)


def test_chat_template_and_token_limits():
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
                {"role": "developer", "content": "ok"}]
    req = parse_chat(_body(messages=messages), 1024, MODEL)
    assert req.prompt == "system: Be terse.\nuser: Hi\nassistant: Hello\ndeveloper: ok\nassistant:"
    assert req.max_tokens == 1024 - len(req.prompt)   # no limit given: the rest of the context
    assert parse_chat(_body(messages=messages[1:2], max_completion_tokens=7), 64, MODEL).max_tokens == 7
    assert parse_chat(_body(messages=messages[1:2], max_tokens=5), 64, MODEL).max_tokens == 5
    # The context counts UTF-8 bytes, the model's tokens: "é" is two.
    assert parse_completion(_body(prompt="é" * 31, max_tokens=2), CONTEXT, MODEL).max_tokens == 2
    with pytest.raises(ProtocolError, match="the prompt is 62 tokens"):
        parse_completion(_body(prompt="é" * 31, max_tokens=3), CONTEXT, MODEL)


def _chat(*messages, **fields) -> bytes:
    return _body(messages=list(messages) or [{"role": "user", "content": "Hi"}], **fields)


BAD = [  # (endpoint, body, status, param, what the message must contain)
    ("c", b"{oops", 400, "body", "not valid JSON"),
    ("c", b"\xff\xfe", 400, "body", "not valid JSON"),
    ("c", b"[" * 50_000, 400, "body", "not valid JSON"),
    ("c", b'"prompt"', 400, "body", "expected a JSON object, got a string"),
    ("c", _body(), 400, "prompt", "expected a string, got null"),
    ("c", _body(prompt=5), 400, "prompt", "expected a string, got an integer"),
    ("c", _body(prompt=["a", "b"]), 400, "prompt", "several prompts or token lists are not supported"),
    ("c", _body(prompt=[72, 105]), 400, "prompt", "several prompts or token lists"),
    ("c", _body(prompt=""), 400, "prompt", "empty"),
    ("c", _body(prompt="a\ud800"), 400, "prompt", "lone UTF-16 surrogate"),
    ("c", _body(prompt="a", stop=["\udfff"]), 400, "stop", "lone UTF-16 surrogate"),
    ("c", _body(prompt="x" * CONTEXT), 400, "prompt", "64 tokens (UTF-8 bytes), which leaves no room"),
    ("c", _body(prompt="x" * 60, max_tokens=5), 400, "max_tokens", "65 in all, over this model's context length of 64: lower max_tokens to at most 4"),
    ("c", _body(prompt="x", max_tokens=0), 400, "max_tokens", "0 is not in [1, 64]"),
    ("c", _body(prompt="x", max_tokens=-3), 400, "max_tokens", "-3 is not in [1, 64]"),
    ("c", _body(prompt="x", max_tokens=10**30), 400, "max_tokens", "is not in [1, 64]"),
    ("c", _body(prompt="x", max_tokens=2.0), 400, "max_tokens", "expected an integer, got a number"),
    ("c", _body(prompt="x", max_tokens="8"), 400, "max_tokens", "expected an integer, got a string"),
    ("c", _body(prompt="x", temperature=-0.1), 400, "temperature", "-0.1 is not in [0, 2]"),
    ("c", _body(prompt="x", temperature=2.5), 400, "temperature", "2.5 is not in [0, 2]"),
    ("c", _body(prompt="x", temperature=True), 400, "temperature", "expected a number, got a boolean"),
    ("c", b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "nan is not in [0, 2]"),
    ("c", _body(prompt="x", top_p=0), 400, "top_p", "0 is not in (0, 1]"),
    ("c", _body(prompt="x", top_p=1.01), 400, "top_p", "1.01 is not in (0, 1]"),
    ("c", _body(prompt="x", top_k=-2), 400, "top_k", "-2 is not in [-1, "),
    ("c", _body(prompt="x", top_k=1.5), 400, "top_k", "expected an integer"),
    ("c", _body(prompt="x", stop=["a"] * 5), 400, "stop", "5 sequences; at most 4 are allowed"),
    ("c", _body(prompt="x", stop=[1]), 400, "stop", "expected a string or a list of strings, got a list"),
    ("c", _body(prompt="x", stop={"a": 1}), 400, "stop", "got an object"),
    ("c", _body(prompt="x", stop=[""]), 400, "stop", "an empty string"),
    ("c", _body(prompt="x", seed=2**64), 400, "seed", "is not in ["),
    ("c", _body(prompt="x", seed="1"), 400, "seed", "expected an integer, got a string"),
    ("c", _body(prompt="x", stream="yes"), 400, "stream", "expected a boolean, got a string"),
    ("c", _body(prompt="x", stream_options={"include_usage": True}), 400, "stream_options", "only allowed with stream=true"),
    ("c", _body(prompt="x", stream=True, stream_options=[]), 400, "stream_options", "expected an object"),
    ("c", _body(prompt="x", stream=True, stream_options={"include_usage": 1}), 400, "stream_options.include_usage", "expected a boolean"),
    ("c", _body(prompt="x", n=2), 400, "n", "only n=1 is supported"),
    ("c", _body(prompt="x", n=True), 400, "n", "only n=1 is supported"),
    ("c", _body(prompt="x", best_of=3), 400, "best_of", "not supported"),
    ("c", _body(prompt="x", echo=True), 400, "echo", "not supported"),
    ("c", _body(prompt="x", logprobs=5), 400, "logprobs", "not supported"),
    ("c", _body(prompt="x", presence_penalty=0.5), 400, "presence_penalty", "not supported"),
    ("c", _body(prompt="x", model="gpt-4o"), 404, "model", "the model 'gpt-4o' does not exist; this server serves 'gpt-tiny'"),
    ("c", _body(prompt="x", model=None), 400, "model", "expected a string, got null"),
    ("h", _body(), 400, "messages", "expected a non-empty list of {role, content}, got null"),
    ("h", _body(messages=[]), 400, "messages", "(empty)"),
    ("h", _body(messages="hi"), 400, "messages", "got a string"),
    ("h", _chat("hi"), 400, "messages[0]", "expected an object with role and content, got a string"),
    ("h", _chat({"role": "tool", "content": "x"}), 400, "messages[0].role", "'tool' is not a role gpudl takes; use one of system, developer, user, assistant"),
    ("h", _chat({"content": "x"}), 400, "messages[0].role", "None is not a role"),
    ("h", _chat({"role": "user", "content": 3}), 400, "messages[0].content", "expected a string or a list of text parts, got an integer"),
    ("h", _chat({"role": "user", "content": "\ud83d"}), 400, "messages", "lone UTF-16 surrogate"),
    ("h", _chat({"role": "user", "content": None}), 400, "messages[0].content", "got null"),
    ("h", _chat({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}), 400, "messages[0].content[0]", "only text parts"),
    ("h", _chat({"role": "user", "content": "x" * 60}), 400, "messages", "77 tokens (UTF-8 bytes) with the chat template, which leaves no room"),
    ("h", _chat(max_completion_tokens=60), 400, "max_completion_tokens", "lower max_completion_tokens to at most 45"),
    ("h", _chat(max_tokens=60), 400, "max_tokens", "over this model's context length of 64"),
    ("h", _chat(max_completion_tokens=0), 400, "max_completion_tokens", "0 is not in [1, 64]"),
    ("h", _chat(tools=[{"type": "function"}]), 400, "tools", "not supported"),
    ("h", _chat(model="other"), 404, "model", "does not exist"),
]


@pytest.mark.parametrize("endpoint, body, status, param, fragment", BAD,
                         ids=[f"{i}:{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_names_the_field(endpoint, body, status, param, fragment):
    parse = parse_completion if endpoint == "c" else parse_chat
    with pytest.raises(ProtocolError) as e:
        parse(body, CONTEXT, MODEL)
    assert (e.value.status, e.value.param) == (status, param)
    assert e.value.message.startswith(f"{param}: ") and fragment in e.value.message
    if status == 404:
        assert e.value.code == "model_not_found"   # OpenAI's code for an unknown model


def test_bodies_validate_as_openai_types():
    c = Completion.model_validate(completion_response(MODEL, "hi", "length", 3, 2))
    assert (c.object, c.choices[0].text, c.choices[0].finish_reason) == ("text_completion", "hi", "length")
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (3, 2, 5)
    assert c.id.startswith("cmpl-") and c.model == MODEL
    chat = ChatCompletion.model_validate(chat_response(MODEL, "yo", "stop", 4, 1, request_id="chatcmpl-1", created=7))
    assert (chat.id, chat.created, chat.object) == ("chatcmpl-1", 7, "chat.completion")
    assert (chat.choices[0].message.role, chat.choices[0].message.content) == ("assistant", "yo")
    assert chat.usage.total_tokens == 5
    models = openai.types.Model.model_validate(models_list([MODEL], created=1)["data"][0])
    assert (models.id, models.object, models.owned_by) == (MODEL, "model", "gpudl")
    assert openai_error("bad", "invalid_request_error", "top_p") == \
        {"error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": None}}


def _events(stream: str) -> list[str]:
    """The data of each event, as the openai client's own SSE decoder reads them."""
    return [sse.data for sse in SSEDecoder().iter_bytes(iter([stream.encode()]))]


def _stream(chunks, tokens: bytes, finish: str = "length", usage: tuple | None = None) -> str:
    """What gpudl's server does with a token stream: bytes through a TextStream, one event per piece of text."""
    decoder, out = TextStream(ByteTokenizer()), []
    for token in tokens:
        text = decoder.feed(token)
        if text:
            out.append(chunks.delta(text))
    out.append(chunks.finish(finish, decoder.finish()))
    if usage:
        out.append(chunks.usage(*usage))
    return "".join(out) + SSE_DONE


def test_sse_framing_and_chat_chunks():
    stream = _stream(chat_chunks(MODEL), ANSWER.encode(), usage=(3, len(ANSWER.encode())))
    assert stream.endswith("\n\ndata: [DONE]\n\n") and all(e.startswith("data: {") for e in stream.split("\n\n")[:-2])
    data = _events(stream)
    assert data[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(d)) for d in data[:-1]]
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"   # the role in the first chunk only
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ANSWER
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ANSWER.encode())


def _handler(request: httpx2.Request) -> httpx2.Response:
    """gpudl's protocol functions behind the openai client's transport; the model 'answers' ANSWER."""
    try:
        if request.url.path.endswith("/models"):
            return httpx2.Response(200, json=models_list([MODEL]))
        chat = request.url.path.endswith("/chat/completions")
        req = (parse_chat if chat else parse_completion)(request.content, 1024, MODEL)
        tokens = ANSWER.encode()[:req.max_tokens]
        finish = "length" if len(tokens) < len(ANSWER.encode()) else "stop"
        if req.stream:
            chunks = (chat_chunks if chat else completion_chunks)(MODEL)
            usage = (len(req.prompt.encode()), len(tokens)) if req.include_usage else None
            return httpx2.Response(200, text=_stream(chunks, tokens, finish, usage),
                                   headers={"content-type": "text/event-stream"})
        respond = chat_response if chat else completion_response
        text = tokens.decode("utf-8", errors="replace")
        return httpx2.Response(200, json=respond(MODEL, text, finish, len(req.prompt.encode()), len(tokens)))
    except ProtocolError as e:
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return httpx2.Response(e.status, json=openai_error(e.message, kind, e.param, e.code))


def _client(strict: bool) -> openai.OpenAI:
    # strict: the client validates every response against its pydantic types instead of trusting it.
    return openai.OpenAI(api_key="k", base_url="http://gpudl.test/v1", max_retries=0, _strict_response_validation=strict,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(_handler)))


def test_openai_client_plain_and_errors():
    client = _client(strict=True)
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
    assert (c.choices[0].text, c.choices[0].finish_reason, c.usage.prompt_tokens) == (ANSWER, "stop", 2)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Gr", "length")
    assert r.usage.prompt_tokens == len("user: Hi\nassistant:")
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", top_p=0)
    assert e.value.param == "top_p" and "top_p: 0 is not in (0, 1]" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.code == "model_not_found"


def test_openai_client_streams():
    chat = _client(strict=True).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, stream_options={"include_usage": True})
    chunks = list(chat)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == len(ANSWER.encode())
    # Completion chunks carry finish_reason null until the last, as OpenAI's do; the client's types call it
    # required, so only the client's default (non-strict) parsing reads them, as it does from OpenAI itself.
    pieces = list(_client(strict=False).completions.create(model=MODEL, prompt="Hi", max_tokens=9, stream=True))
    assert all(isinstance(p, Completion) and p.object == "text_completion" for p in pieces)
    assert "".join(p.choices[0].text for p in pieces) == ANSWER.encode()[:9].decode("utf-8", "replace")
    assert [p.choices[0].finish_reason for p in pieces][-2:] == [None, "length"]


def _mutate(value, rng: random.Random):
    odd = [None, True, False, -1, 0, 1, 2**70, 2.5, float("nan"), float("inf"), "", "x", [], {}, [1], ["a"] * 5,
           {"role": "user"}, {"type": "text"}, "\ud800"]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        roll = rng.random()
        if roll < 0.15:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: rng.choice(odd) if roll < 0.5 else _mutate(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return value[:i] + [rng.choice(odd) if rng.random() < 0.4 else _mutate(value[i], rng)] + value[i + 1:]
    return rng.choice(odd)


def test_fuzz_only_protocol_errors_escape():
    rng = random.Random(4321)
    completion = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
                  "stop": ["\n", "."], "seed": 3, "stream": True, "stream_options": {"include_usage": True}}
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "s"},
                                         {"role": "user", "content": [{"type": "text", "text": "t"}]}],
            "max_completion_tokens": 8, "temperature": 0, "n": 1}
    outcomes = {"ok": 0, "error": 0}
    for case in range(3000):
        parse, base = (parse_completion, completion) if case % 2 else (parse_chat, chat)
        if case % 5 == 0:
            body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(48)))
        else:
            body = json.dumps(_mutate(base, rng)).encode()
        try:
            req = parse(body, CONTEXT, MODEL)
            # What the server does next must not fail: encode the prompt and stops, fit the context.
            assert 1 <= req.max_tokens and len(req.prompt.encode("utf-8")) + req.max_tokens <= CONTEXT
            assert all(s.encode("utf-8") for s in req.stop) and req.n == 1
            outcomes["ok"] += 1
        except ProtocolError as e:
            assert e.status in (400, 404) and e.param and e.message.startswith(f"{e.param}: ")
            outcomes["error"] += 1
    assert outcomes["error"] > 1000 and outcomes["ok"] > 300
