"""`gpudl serve`'s HTTP face (FastAPI): the Open Inference Protocol v2 of KServe and Triton for every
model, the OpenAI API for GPT models, Prometheus metrics. The routes only translate: the wire
formats are `oip.py` and `openai_api.py`, the batching is the engine's (`engine.py`), and the key
and body limit are checked before any route runs (`guard.py`).

Anything a client sent wrong is a 4xx with `{"error": ...}` naming the field (OpenAI routes: the
OpenAI error shape); a request that could not start within --max-wait-s (or finds the queue full)
is 429 with Retry-After, one that waited past its deadline 504. A 500 would be a bug in gpudl,
never a client's doing. Each request is served from its client's share (`guard.client_of`: its
key's hash and its X-Tenant header) at its `priority`; a client that disconnects while its request
waits takes the request out of the queue (non-streaming: watched here; streaming: Starlette
cancels the stream, whose iterator then leaves the queue).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..data.tokenizer import ByteTokenizer
from . import oip, oip_reply, openai_api
from .detok import longest_token_bytes
from .engine import BadInput, DeadlineExceeded, EngineStopped, Overloaded
from .guard import client_of
from .metrics import Metrics

RETRY_AFTER_S = 1
OIP_TOKENS = 64          # tokens a GPT adds to a text_input over the Open Inference Protocol
CHAT_STOP = "\nuser:"   # a chat answer ends where the model starts the user's next turn


@dataclass
class Served:
    """What the app serves: filled in once the model has loaded (`ready`)."""

    name: str
    request_timeout_s: float = 60.0
    max_body_bytes: int = 64 * 2**20
    loaded: object | None = None          # load.Loaded
    engine: object | None = None          # BatchingEngine or GenerationEngine
    metrics: Metrics | None = None
    key_required: bool = False
    server: object | None = None          # the uvicorn server, told to exit when loading fails
    threads: str | None = None            # on the CPU: the intra-op threads chosen, and why
    started: float = field(default_factory=time.time)
    # keys are hashed with it into client names (guard.client_of): no key is kept, and the names
    # say nothing outside this process
    client_salt: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)

    @property
    def ready(self) -> bool:
        return self.engine is not None


def create_app(served: Served, lifespan=None) -> FastAPI:
    app = FastAPI(title="gpudl", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.served = served
    _error_handlers(app)
    _oip_routes(app, served)
    _openai_routes(app, served)

    @app.get("/metrics")
    def metrics() -> Response:
        if served.metrics is None:
            raise oip.ProtocolError(503, f"model {served.name!r} is still loading: no metrics yet")
        return Response(served.metrics.text(), media_type="text/plain; version=0.0.4")
    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(oip.ProtocolError)
    async def protocol(request: Request, e: oip.ProtocolError):
        return _error(request, e.status, e.message, param=e.param, code=e.code)

    @app.exception_handler(BadInput)
    async def bad_input(request: Request, e: BadInput):
        return _error(request, 400, str(e))

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, e: Overloaded):
        retry = max(1, math.ceil(e.retry_after_s))
        return _error(request, 429, f"the server is at capacity: {e}", {"Retry-After": str(retry)},
                      code="rate_limit_exceeded")

    @app.exception_handler(DeadlineExceeded)
    async def late(request: Request, e: DeadlineExceeded):
        return _error(request, 504, "the request waited past its deadline in the queue")

    @app.exception_handler(EngineStopped)
    async def stopping(request: Request, e: EngineStopped):
        return _error(request, 503, "the server is shutting down", {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(HTTPException)
    async def http(request: Request, e: HTTPException):
        return _error(request, e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return _error(request, 400, "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()))


def _error(request: Request, status: int, message: str, headers: dict | None = None, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    body = openai_api.openai_error(message, _openai_type(status), param, code) \
        if request.url.path.startswith("/v1/") else oip_reply.error_body(message)
    return JSONResponse(body, status_code=status, headers=headers)


def _openai_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "requests", 503: "server_error",
            504: "timeout"}.get(status, "server_error")


async def _unless_disconnected(request: Request, answer):
    """Await `answer` (an engine's coroutine) unless the client disconnects first: then this handler
    is cancelled, which takes a request still queued out of the queue before it costs model time, and
    None is returned. (Starlette does this for streams only; uvicorn says so by `http.disconnect`.)
    One watching task and the answer awaited in place: watching with a task for the answer as well
    and an asyncio.wait cost about 8% of gpt-tiny's tokens/s at twice the rated load on two cores."""
    handler, left = asyncio.current_task(), []

    def hang_up(watcher: asyncio.Task) -> None:
        if not watcher.cancelled() and watcher.exception() is None:
            left.append(True)
            handler.cancel()
    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(hang_up)
    try:
        return await answer
    except asyncio.CancelledError:
        if not left:
            raise  # cancelled for another reason: the server is stopping
        handler.uncancel()
        return None
    finally:
        watcher.remove_done_callback(hang_up)
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the status is for the logs


def _model(served: Served, name: str):
    if name != served.name:
        raise oip.ProtocolError(404, f"unknown model {name!r}: this server serves {served.name!r}")
    if not served.ready:
        raise oip.ProtocolError(503, f"model {name!r} is still loading")
    return served.loaded


def _oip_routes(app: FastAPI, served: Served) -> None:
    @app.get("/v2/health/live")
    def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    def ready():
        if not served.ready:
            return JSONResponse({"ready": False}, status_code=503)
        return {"ready": True}

    @app.get("/v2")
    def server():
        return oip_reply.server_metadata()

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    def metadata(name: str, version: str = "1"):
        loaded = _model(served, name)
        return oip_reply.model_metadata(name, ["1"], "pytorch_gpudl", loaded.inputs, loaded.outputs)

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    def model_ready(name: str, version: str = "1"):
        _model(served, name)
        return {"name": name, "ready": True}

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str = "1"):
        arrived = time.monotonic()
        loaded = _model(served, name)
        client = client_of(request.headers, served.client_salt)
        served.engine.precheck(client)  # refused before its body is parsed, if it would be anyway
        header = request.headers.get("inference-header-content-length")
        parsed = oip.parse_infer_request(await request.body(), int(header) if header and header.isdigit() else None,
                                         {s.name: s for s in loaded.inputs}, max_body_bytes=served.max_body_bytes,
                                         output_names=[s.name for s in loaded.outputs])
        ticket = dict(deadline=arrived + served.request_timeout_s, client=client, priority=parsed.priority)
        given = parsed.inputs[loaded.inputs[0].name]
        work = _texts(served, given, ticket) if loaded.kind == "gpt" else _logits(served, given, ticket)
        answer = await _unless_disconnected(request, work)
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        body, headers = oip_reply.encode_infer_response(name, "1", parsed.id, {loaded.outputs[0].name: answer},
                                                  parsed.outputs, binary_default=parsed.binary_data_output)
        return Response(body, headers=headers, media_type=headers.get("Content-Type", "application/json"))


async def _logits(served: Served, given: np.ndarray, ticket: dict) -> np.ndarray:
    return (await served.engine.infer(torch.from_numpy(given), **ticket)).float().numpy()


async def _texts(served: Served, prompts: np.ndarray, ticket: dict) -> np.ndarray:
    """GPT over the Open Inference Protocol: each text_input element continued greedily by
    OIP_TOKENS tokens (the OpenAI routes take sampling settings); text_output is the new text, UTF-8.
    One element refused, failed or left cancels the others: nobody would read their answers."""
    from .generation import Sampling

    greedy = Sampling(max_tokens=OIP_TOKENS, temperature=0.0)
    ids = [_oip_prompt(served.loaded, bytes(p), i) for i, p in enumerate(prompts.reshape(-1))]
    tasks = [asyncio.ensure_future(served.engine.complete(p, greedy, **ticket)) for p in ids]
    try:
        done = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    return np.array([d.text.encode("utf-8") for d in done], dtype=object).reshape(prompts.shape)


def _oip_prompt(loaded, raw: bytes, i: int) -> list[int]:
    """A text_input element's token ids: its bytes for a byte-level model (which reads any bytes),
    else its UTF-8 text through the model's tokenizer."""
    where = f"text_input element {i}"
    if len(raw) > loaded.context_length * longest_token_bytes(loaded.tokenizer) * 2:  # as openai_api's _encode
        raise oip.ProtocolError(400, f"{where}: {len(raw)} bytes, more than this model's context length of "
                                     f"{loaded.context_length} tokens can hold; shorten it")
    if isinstance(loaded.tokenizer, ByteTokenizer):
        return list(raw)
    try:
        return loaded.tokenizer.encode(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise oip.ProtocolError(400, f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); this model's "
                                     f"tokenizer reads text") from None


def _openai_routes(app: FastAPI, served: Served) -> None:
    @app.get("/v1/models")
    def models():
        return openai_api.models_list([served.name] if served.ready and served.loaded.kind == "gpt" else [])

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(served, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(served, request, chat=True)


async def _generate(served: Served, request: Request, chat: bool):
    from .generation import Sampling

    if not served.ready:
        raise oip.ProtocolError(503, f"model {served.name!r} is still loading")
    if served.loaded.kind != "gpt":
        raise oip.ProtocolError(404, f"model {served.name!r} is a classifier: it answers /v2/models/{served.name}/infer, "
                                     f"not the OpenAI API")
    arrived = time.monotonic()
    client = client_of(request.headers, served.client_salt)
    served.engine.precheck(client)  # refused before its body is parsed, if it would be anyway
    parse = openai_api.parse_chat if chat else openai_api.parse_completion
    req = parse(await request.body(), served.loaded.context_length, served.name, served.loaded.tokenizer)
    stop = [*req.stop, CHAT_STOP] if chat and CHAT_STOP not in req.stop else req.stop
    sampling = Sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k or 0,
                        top_p=req.top_p, stop=tuple(stop), seed=req.seed)
    prompt = req.prompt_ids
    ticket = dict(deadline=arrived + served.request_timeout_s, client=client, priority=req.priority)
    if req.stream:  # queued now: a refusal (400, 429) is still a status, before the stream's 200 goes out
        items = served.engine.stream(prompt, sampling, **ticket)
        return StreamingResponse(_stream(served, req, len(prompt), items, chat),
                                 media_type="text/event-stream")
    done = await _unless_disconnected(request, served.engine.complete(prompt, sampling, **ticket))
    if done is None:
        return Response(status_code=CLIENT_GONE)
    respond = openai_api.chat_response if chat else openai_api.completion_response
    return respond(served.name, done.text, done.finish, len(prompt), len(done.ids))


async def _stream(served: Served, req, prompt_tokens: int, items, chat: bool):
    """Server-sent events: one chunk per piece of text the engine made certain, the finish reason, then [DONE].
    (Its times and tokens are counted by the engine's metrics as the items pass: metrics.Tracked.)"""
    chunks = openai_api.chat_chunks if chat else openai_api.completion_chunks
    stream = chunks(served.name)
    produced = 0
    try:
        async for item in items:
            if item.token is not None:
                produced += 1
            if item.finish is not None:
                yield stream.finish(item.finish, item.text)
                if req.include_usage:
                    yield stream.usage(prompt_tokens, produced)
            elif item.text:
                yield stream.delta(item.text)
        yield openai_api.SSE_DONE
    finally:  # a client that left mid-stream: cancel its request now, not when the garbage collector gets to it
        items.close()
