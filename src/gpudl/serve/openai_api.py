"""The OpenAI-compatible API for gpudl's GPT models: `/v1/completions`, `/v1/chat/completions` (plain
and streamed as server-sent events) and `/v1/models`, as pure functions from request bytes to a
`CompletionRequest` and from generated text to response bodies.

Prompts are encoded with the served model's tokenizer (bytes unless its run kept a
`tokenizer.json`): `usage`, `max_tokens` and the context-length check count its tokens.

Chat messages become one prompt with a plain template, one line per message and an open turn for
the model, since the models know no special tokens:

    system: You are terse.
    user: Hi
    assistant:

Every refused request raises `ProtocolError` (from `oip`, the one error type of the server) whose
`param` is the field at fault, for OpenAI's error shape (`openai_error`).

>>> parse_completion(b'{"model": "gpt", "prompt": "Hi", "max_tokens": 5}', 64, "gpt").max_tokens
5
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..data.tokenizer import ByteTokenizer, Tokenizer
from .detok import longest_token_bytes
from .oip import ProtocolError, kind_of
from .sse import SSE_DONE, sse_event

__all__ = ["CompletionRequest", "parse_completion", "parse_chat", "completion_response", "chat_response",
           "completion_chunks", "chat_chunks", "models_list", "openai_error", "SSE_DONE",
           "CHAT_ROLES"]

MAX_STOP = 4
DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant")
SEED_RANGE = (-(2**63), 2**64 - 1)   # what torch.Generator.manual_seed accepts
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
BYTES = ByteTokenizer()               # the tokenizer of a model that kept none
# Fields whose non-default values would change the answer in ways gpudl does not implement: refused
# rather than silently ignored. Any other unknown field is ignored, as clients add their own.
_UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0), "suffix": (None,),
                "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
                "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
                "top_logprobs": (None, 0)}


@dataclass(kw_only=True)
class CompletionRequest:
    """A validated completion or chat request, as the generation engine takes it."""

    prompt: str                     # the chat template already applied for chat requests
    max_tokens: int
    model: str
    temperature: float = 1.0        # 0 is greedy
    top_p: float = 1.0
    top_k: int | None = None        # an extension to the OpenAI API; None or 0 means off
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False     # stream_options.include_usage: a last chunk with usage
    n: int = 1
    priority: int = 0               # vLLM's extension: lower is served earlier, within the client's share
    prompt_ids: list[int] = field(default_factory=list, compare=False, repr=False)   # the prompt, encoded


def _bad(param: str, message: str, status: int = 400, code: str | None = None) -> ProtocolError:
    return ProtocolError(status, f"{param}: {message}", param=param, code=code)


def _load(body: bytes) -> dict:
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        raise _bad("body", f"not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(request, dict):
        raise _bad("body", f"expected a JSON object, got {kind_of(request)}")
    return request


def _number(request: dict, key: str, default, lo: float, hi: float, *, lo_open: bool = False,
            integer: bool = False):
    value = request.get(key)
    if value is None:
        return default
    types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, types):
        raise _bad(key, f"expected {'an integer' if integer else 'a number'}, got {kind_of(value)}")
    if value != value or value < lo or value > hi or (lo_open and value == lo):   # value != value: NaN
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise _bad(key, f"{value} is not in {interval}")
    return value


def _flag(request: dict, key: str, default: bool = False, where: str = "") -> bool:
    value = request.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(where + key, f"expected a boolean, got {kind_of(value)}")
    return value


def _stop(request: dict) -> list[str]:
    stop = request.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", f"expected a string or a list of strings, got {kind_of(request['stop'])}")
    if len(stop) > MAX_STOP:
        raise _bad("stop", f"{len(stop)} sequences; at most {MAX_STOP} are allowed")
    for s in stop:
        _utf8(s, "stop")
    if "" in stop:
        raise _bad("stop", "an empty string would stop before the first token; remove it")
    return stop


def _utf8(text: str, param: str) -> bytes:
    # JSON may carry lone UTF-16 surrogates ("\\ud800"), which have no UTF-8 bytes: the model could not
    # read them, so they are refused here rather than failing later in the server.
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(param, "contains a lone UTF-16 surrogate, which is not text; send valid Unicode") from None


def _model(request: dict, default_model: str) -> str:
    model = request.get("model", default_model)
    if not isinstance(model, str):
        raise _bad("model", f"expected a string, got {kind_of(model)}")
    if model != default_model:
        raise _bad("model", f"the model {model!r} does not exist; this server serves {default_model!r}",
                   status=404, code="model_not_found")
    return model


def _refuse_unsupported(request: dict) -> None:
    for key, allowed in _UNSUPPORTED.items():
        if key in request and not any(_matches(request[key], a) for a in allowed):
            raise _bad(key, f"{request[key]!r} is not supported by gpudl; leave it out")
    n = request.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise _bad("n", f"{n!r}: only n=1 is supported; send one request per completion")


def _matches(value, default) -> bool:
    """JSON equality: 0 and 0.0 match, but false is not 0 and "0" is not 0."""
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and value == default
    return type(value) is type(default) and value == default


def _stream_options(request: dict, stream: bool) -> bool:
    options = request.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("stream_options", "only allowed with stream=true")
    if not isinstance(options, dict):
        raise _bad("stream_options", f"expected an object, got {kind_of(options)}")
    return _flag(options, "include_usage", where="stream_options.")


def _encode(prompt: str, param: str, context_length: int, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids, refused when they leave no room in the context."""
    raw, templated = _utf8(prompt, param), " with the chat template" if param == "messages" else ""
    # A prompt far too long is refused before it is encoded (a client's 64 MiB would cost the server
    # gigabytes of token objects): x2, as a tokenizer's normaliser may drop some of the text.
    most = context_length * longest_token_bytes(tokenizer) * 2
    if len(raw) > most:
        raise _bad(param, f"{len(raw)} UTF-8 bytes{templated}, more than this model's context length of "
                          f"{context_length} tokens can hold; shorten it")
    ids = tokenizer.encode(prompt)
    if len(ids) >= context_length:
        unit = " (UTF-8 bytes)" if tokenizer.name == "bytes" else ""
        raise _bad(param, f"{len(ids)} tokens{unit}{templated}, which leaves no room in this "
                          f"model's context length of {context_length}; shorten it")
    return ids


def _sampling(request: dict, prompt: str, prompt_ids: list[int], prompt_param: str, max_tokens: int,
              max_param: str, model: str, context_length: int) -> CompletionRequest:
    _refuse_unsupported(request)
    prompt_tokens = len(prompt_ids)
    if prompt_tokens + max_tokens > context_length:
        raise _bad(max_param, f"the prompt is {prompt_tokens} tokens and {max_param} is "
                                 f"{max_tokens}, {prompt_tokens + max_tokens} in all, over this model's context "
                                 f"length of {context_length}: lower {max_param} to at most "
                                 f"{context_length - prompt_tokens} or shorten the {prompt_param}")
    top_k = _number(request, "top_k", None, -1, 2**31 - 1, integer=True)
    stream = _flag(request, "stream")
    return CompletionRequest(
        prompt=prompt, max_tokens=max_tokens, model=model,
        temperature=float(_number(request, "temperature", 1.0, 0, 2)),
        top_p=float(_number(request, "top_p", 1.0, 0, 1, lo_open=True)),
        top_k=top_k if top_k and top_k > 0 else None,   # 0 and -1 (vLLM's "off") mean no top-k
        stop=_stop(request), seed=_number(request, "seed", None, *SEED_RANGE, integer=True),
        stream=stream, include_usage=_stream_options(request, stream), prompt_ids=prompt_ids,
        priority=_number(request, "priority", 0, *PRIORITY_RANGE, integer=True))


def parse_completion(body: bytes, context_length: int, default_model: str,
                     tokenizer: Tokenizer = BYTES) -> CompletionRequest:
    """A `/v1/completions` request: `prompt` is a string (or a list holding one string), encoded
    with `tokenizer`.

    >>> parse_completion(b'{"prompt": "Hi", "stop": "\\\\n", "temperature": 0}', 64, "gpt").stop
    ['\\n']
    """
    request = _load(body)
    model = _model(request, default_model)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("prompt", f"expected a string, got {kind_of(prompt)}"
                             + (" (several prompts or token lists are not supported)" if isinstance(prompt, list) else ""))
    if not prompt:
        raise _bad("prompt", "empty; the model needs at least one byte to continue")
    max_tokens = _number(request, "max_tokens", DEFAULT_MAX_TOKENS, 1, context_length, integer=True)
    ids = _encode(prompt, "prompt", context_length, tokenizer)
    return _sampling(request, prompt, ids, "prompt", max_tokens, "max_tokens", model, context_length)


def parse_chat(body: bytes, context_length: int, default_model: str, tokenizer: Tokenizer = BYTES) -> CompletionRequest:
    """A `/v1/chat/completions` request: `messages` rendered by `chat_prompt`. Without
    `max_completion_tokens` (or the older `max_tokens`) the answer may fill the rest of the context.

    >>> parse_chat(b'{"messages": [{"role": "user", "content": "Hi"}]}', 64, "gpt").prompt
    'user: Hi\\nassistant:'
    """
    request = _load(body)
    model = _model(request, default_model)
    prompt = chat_prompt(request.get("messages"))
    key = "max_completion_tokens" if request.get("max_completion_tokens") is not None else "max_tokens"
    ids = _encode(prompt, "messages", context_length, tokenizer)
    max_tokens = _number(request, key, context_length - len(ids), 1, context_length, integer=True)
    return _sampling(request, prompt, ids, "messages", max_tokens, key, model, context_length)


def chat_prompt(messages) -> str:
    """One line `role: content` per message, then `assistant:` for the model to continue."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"expected a non-empty list of {{role, content}}, got {kind_of(messages)}"
                               + (" (empty)" if messages == [] else ""))
    lines = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, f"expected an object with role and content, got {kind_of(message)}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role", f"{role!r} is not a role gpudl takes; use one of {', '.join(CHAT_ROLES)}")
        lines.append(f"{role}: {_content(message.get('content'), f'{where}.content')}\n")
    return "".join(lines) + "assistant:"


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{j}]", "only text parts {type: 'text', text: ...} are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(where, f"expected a string or a list of text parts, got {kind_of(content)}")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(kind: str, prefix: str, model: str, request_id: str | None, created: int | None) -> dict:
    return {"id": request_id or f"{prefix}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()) if created is None else created, "model": model}


def completion_response(model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                        *, request_id: str | None = None, created: int | None = None) -> dict:
    """A `text_completion` body; `finish_reason` is "stop" (a stop sequence) or "length" (max_tokens)."""
    body = _envelope("text_completion", "cmpl", model, request_id, created)
    body["choices"] = [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]
    body["usage"] = _usage(prompt_tokens, completion_tokens)
    return body


def chat_response(model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                  *, request_id: str | None = None, created: int | None = None) -> dict:
    """A `chat.completion` body with one assistant message."""
    body = _envelope("chat.completion", "chatcmpl", model, request_id, created)
    body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": finish_reason}]
    body["usage"] = _usage(prompt_tokens, completion_tokens)
    return body


class _Chunks:
    """The events of one streamed answer, all with the same id and creation time. Each method
    returns one framed server-sent event; the stream then ends with `SSE_DONE`."""

    kind = prefix = ""

    def __init__(self, model: str):
        self.head = _envelope(self.kind, self.prefix, model, None, None)

    def delta(self, text: str) -> str:
        """A piece of generated text."""
        return sse_event({**self.head, "choices": [self._choice(text, None)]})

    def finish(self, finish_reason: str, text: str = "") -> str:
        """The last piece (often empty) with the finish reason."""
        return sse_event({**self.head, "choices": [self._choice(text, finish_reason)]})

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        """For stream_options.include_usage: the chunk after the finish, no choices, with usage."""
        return sse_event({**self.head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})


class _CompletionChunks(_Chunks):
    kind, prefix = "text_completion", "cmpl"

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}


class _ChatChunks(_Chunks):
    kind, prefix = "chat.completion.chunk", "chatcmpl"
    _role_sent = False

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        delta = {"content": text}
        if not self._role_sent:   # OpenAI names the role in the first chunk only
            delta, self._role_sent = {"role": "assistant", **delta}, True
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def completion_chunks(model: str) -> _Chunks:
    """The SSE events of a streamed `/v1/completions` answer (`text_completion` chunks).

    >>> chunks = completion_chunks("gpt")
    >>> chunks.delta("Hi").startswith('data: {"id":"cmpl-')
    True
    """
    return _CompletionChunks(model)


def chat_chunks(model: str) -> _Chunks:
    """The SSE events of a streamed chat answer (`chat.completion.chunk`, the role in the first)."""
    return _ChatChunks(model)


def models_list(names: list[str], created: int | None = None) -> dict:
    """The body of `GET /v1/models`."""
    created = int(time.time()) if created is None else created
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "gpudl"} for name in names]}


def openai_error(message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
