"""What every request passes before a route sees it: the API key, and the size of its body.

Binding anything but loopback needs a key (`--api-key` or GPUDL_API_KEY): without one the server
refuses to start. The key is checked on every request, health and metrics included, in constant
time (`hmac.compare_digest`), from `Authorization: Bearer KEY` (what OpenAI clients send) or
`X-API-Key: KEY`. A body is read in full here, up to the limit: one over it is answered 413
before any route parses a byte of it, so a client cannot make the server hold more than the
limit per request.

Who sent a request (`client_of`), for the fair share of the engine it is served from: a keyed hash
of the key it presents, and the tenant its `X-Tenant` header names within that key's share.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os

from ..errors import UserError
from .oip import ProtocolError

API_KEY_ENV = "GPUDL_API_KEY"
TENANT_HEADER = "x-tenant"
MAX_TENANT = 64  # characters: a tenant's name is kept while its requests wait, so it is bounded


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that resolves elsewhere: treated as reachable from other machines


def api_key_for(host: str, flag: str | None) -> str | None:
    """The key requests must carry: the flag's, else the environment's; required off loopback."""
    key = flag or os.environ.get(API_KEY_ENV) or None
    if key is None and not is_loopback(host):
        raise UserError(f"--host {host} lets other machines connect: give --api-key KEY (or set {API_KEY_ENV}) so "
                        f"that only clients with the key are served, or bind --host 127.0.0.1")
    return key


def authorized(headers: dict[bytes, bytes], key: str) -> bool:
    given = headers.get(b"x-api-key", b"")
    bearer = headers.get(b"authorization", b"")
    if bearer[:7].lower() == b"bearer ":
        given = bearer[7:].strip()
    return hmac.compare_digest(given, key.encode())


def client_of(headers, salt: bytes) -> str:
    """The client a request is served for (`headers`: a request's, read case-insensitively): a
    keyed hash (HMAC-SHA256 with `salt`) of the key it presents, the same headers `authorized`
    reads ("anonymous" without one), then "/" and its X-Tenant header where it sends one. The
    tenant divides the key's share: a gateway holding one key names its users, and clients of a
    loopback server without a key may name themselves. Never the key itself: the name is kept
    while the request waits."""
    bearer = headers.get("authorization", "")
    key = bearer[7:].strip() if bearer[:7].lower() == "bearer " else headers.get("x-api-key", "")
    who = hmac.new(salt, key.encode(), "sha256").hexdigest()[:16] if key else "anonymous"
    tenant = headers.get(TENANT_HEADER)
    if tenant is None:
        return who
    if not 0 < len(tenant) <= MAX_TENANT:
        raise ProtocolError(400, f"X-Tenant: {len(tenant)} characters; name the tenant in 1 to {MAX_TENANT}",
                            param="X-Tenant")
    return f"{who}/{tenant}"


class Guard:
    """ASGI middleware: refuses a request without the key (401), or with a body over `max_body_bytes`
    (413), and hands the routes the body it read."""

    def __init__(self, app, key: str | None, max_body_bytes: int):
        self.app, self.key, self.max_body_bytes = app, key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None and not authorized(headers, self.key):
            return await _answer(send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY' or "
                                            "'X-API-Key: KEY'", [(b"www-authenticate", b"Bearer")])
        body = await self._body(headers, receive)
        if body is None:
            return await _answer(send, 413, f"the request body is over the limit of {self.max_body_bytes} bytes")
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # after the body: wait for the client to disconnect, as the server would
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.app(scope, replay, send)

    async def _body(self, headers: dict[bytes, bytes], receive) -> bytes | None:
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body"):
                break
        return b"".join(chunks)


async def _answer(send, status: int, message: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": body})
