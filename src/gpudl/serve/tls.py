"""TLS for `gpudl serve`: the certificate files checked before anything starts, and uvicorn's settings.

Each file is loaded here with the same `ssl` calls uvicorn makes later, so a missing file, a file that
is not a certificate or key, a key that does not match its certificate, or a key behind a passphrase
(which OpenSSL would otherwise ask for on the terminal as the server starts) is one line
naming the flag and the fix, instead of a traceback from inside uvicorn. With `--ssl-ca-certs` the
server asks every client for a certificate signed by that CA and refuses the handshake without one
(ssl.CERT_REQUIRED): the connection ends before any HTTP is read.
"""

from __future__ import annotations

import ssl

from ..errors import UserError

_MAKE_ONE = ("or make a self-signed pair with `openssl req -x509 -newkey rsa:2048 -nodes -keyout key.pem "
             "-out cert.pem -subj /CN=HOST -addext subjectAltName=DNS:HOST`")


class _Encrypted(Exception):
    """Raised by the password callback: the key needs a passphrase, which `gpudl serve` does not take."""


def check_tls(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    """Refuse, in one line each, what uvicorn would fail on (or prompt for) after starting."""
    if ca_certs and not certfile:
        raise UserError("--ssl-ca-certs asks clients for a certificate during the TLS handshake: give "
                        "--ssl-certfile and --ssl-keyfile too (the server's own certificate and key)")
    if bool(certfile) != bool(keyfile):
        given, missing = ("--ssl-certfile", "--ssl-keyfile") if certfile else ("--ssl-keyfile", "--ssl-certfile")
        raise UserError(f"{given} needs {missing} too: TLS takes the server's certificate and its private key "
                        f"(PEM files from your CA, {_MAKE_ONE})")
    if not certfile:
        return
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs)):
        if path:
            _readable(flag, path)
    _certificates("--ssl-certfile", certfile, f"give the server's certificate file, not its key, {_MAKE_ONE}")
    _key_pair(certfile, keyfile)
    if ca_certs:
        _certificates("--ssl-ca-certs", ca_certs, "give the certificate of the CA that signs the clients' "
                                                  "certificates")


def uvicorn_ssl(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> dict:
    """uvicorn.Config's ssl_* arguments; empty without TLS. A CA means client certificates are required."""
    if not certfile:
        return {}
    return {"ssl_certfile": certfile, "ssl_keyfile": keyfile, "ssl_ca_certs": ca_certs,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if ca_certs else ssl.CERT_NONE}


def _readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        reason = (e.strerror or str(e)).lower()
        raise UserError(f"{flag} {path}: {reason}: give the path of a readable PEM file") from None


def _certificates(flag: str, path: str, fix: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=path)
    except ssl.SSLError:
        raise UserError(f"{flag} {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----): {fix}") from None


def _key_pair(certfile: str, keyfile: str) -> None:
    def no_passphrase():
        raise _Encrypted

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=no_passphrase)
    except _Encrypted:
        raise UserError(f"--ssl-keyfile {keyfile} is encrypted: gpudl serve reads unencrypted keys only; write one "
                        f"with `openssl pkey -in {keyfile} -out server.key` and keep it readable by this user "
                        f"alone") from None
    except ssl.SSLError as e:  # OpenSSL's reason ("PEM lib") would not tell a user more than this does
        if "KEY_VALUES_MISMATCH" in str(e):
            raise UserError(f"--ssl-keyfile {keyfile} is not the key of --ssl-certfile {certfile}: give the key the "
                            f"certificate was made with") from None
        raise UserError(f"--ssl-keyfile {keyfile} does not load as the private key of --ssl-certfile {certfile}: "
                        f"give the PEM private key (-----BEGIN PRIVATE KEY-----) the certificate "
                        f"was made with") from None


def uvicorn_server(config):
    """uvicorn.Server for `config`; over TLS, one whose shutdown drops the connections that are idle.

    uvicorn closes an idle keep-alive connection when it shuts down, and over TLS asyncio then waits up
    to 30 s for the client's close_notify. A client idle in its connection pool (every OpenAI or httpx
    client between requests) sends none until its next request, so SIGTERM took the whole grace period
    whenever one was connected. An idle connection holds nothing to finish: it is aborted at once, as
    TLS allows (RFC 8446 6.1: a closing side need not wait for the peer's close_notify). Connections
    with a response still in flight (streams) are left to uvicorn's graceful drain.
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", False)  # False: not an HTTP connection (a websocket)
                if cycle is None or (cycle and cycle.response_complete):
                    connection.transport.abort()
            await super().shutdown(sockets)

    return Server(config) if config.is_ssl else uvicorn.Server(config)
