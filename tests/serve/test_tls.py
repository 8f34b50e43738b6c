"""`gpudl serve` over TLS: a real server on loopback with certificates made here by the openssl CLI (a CA,
the server's certificate for 127.0.0.1, client certificates from that CA and from a stranger CA), asked
by the openai package and httpx over real handshakes; plain HTTP to the TLS port, clients without a
certificate, and bad certificate files are refused."""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import run_cli
from test_http import Server, _free_port, _greedy, _reference, gpt_run  # noqa: F401  gpt_run: the fixture

openai = pytest.importorskip("openai")
if shutil.which("openssl") is None:
    pytest.skip("the openssl command makes the test certificates and is not on PATH", allow_module_level=True)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True)


def _signed(folder: Path, name: str, ca: str, ext: str) -> None:
    """NAME.key and NAME.pem: a P-256 key and its certificate signed by CA (CA.key, CA.pem), with extension EXT."""
    (folder / f"{name}.ext").write_text(ext + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=folder)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem signs server.pem (for IP 127.0.0.1) and client.pem; stranger-ca.pem signs stranger.pem."""
    folder = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "stranger-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                 f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=gpudl test {ca}", cwd=folder)
    _signed(folder, "server", "ca", "subjectAltName=IP:127.0.0.1")
    _signed(folder, "client", "ca", "extendedKeyUsage=clientAuth")
    _signed(folder, "stranger", "stranger-ca", "extendedKeyUsage=clientAuth")
    (folder / "not-a-certificate.pem").write_text("hello\n")
    return folder


def _trusting(pki: Path, client: str | None = None) -> ssl.SSLContext:
    """A client's context that trusts only the test CA, presenting CLIENT's certificate if given."""
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client:
        context.load_cert_chain(pki / f"{client}.pem", pki / f"{client}.key")
    return context


def _tls_args(pki: Path, *, clients: bool = False) -> list[str]:
    args = ["--ssl-certfile", str(pki / "server.pem"), "--ssl-keyfile", str(pki / "server.key")]
    return args + (["--ssl-ca-certs", str(pki / "ca.pem")] if clients else [])


@pytest.fixture(scope="module")
def tls_server(gpt_run, pki):  # noqa: F811  gpt_run is test_http's fixture, imported above
    server = Server(gpt_run, *_tls_args(pki), verify=_trusting(pki))
    yield server
    _, out = server.stop()
    assert f"at https://127.0.0.1:{server.port}" in out and "client certificate" not in out, out


def test_the_openai_client_trusting_the_ca_gets_the_greedy_text_over_https(tls_server, gpt_run, pki):  # noqa: F811
    assert tls_server.url.startswith("https://")
    client = openai.OpenAI(base_url=tls_server.url + "/v1", api_key="unused",
                           http_client=openai.DefaultHttpxClient(verify=_trusting(pki)))
    want = _greedy(_reference(gpt_run), b"def ", 12).decode("utf-8", errors="replace")
    plain = client.completions.create(model="gpt-tiny", prompt="def ", max_tokens=12, temperature=0)
    assert plain.choices[0].text == want
    streamed = client.completions.create(model="gpt-tiny", prompt="def ", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    chat = client.chat.completions.create(model="gpt-tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and 1 <= chat.usage.completion_tokens <= 5
    # A client that trusts only the system's CAs must not accept the server's certificate.
    stranger = openai.OpenAI(base_url=tls_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        stranger.completions.create(model="gpt-tiny", prompt="def ", max_tokens=2)


def test_plain_http_to_the_tls_port_gets_no_http_answer(tls_server, pki):
    plain_url = tls_server.url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.post(plain_url + "/v1/completions", json={"model": "gpt-tiny", "prompt": "x", "max_tokens": 2},
                   timeout=10)
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=10) as raw:
        raw.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = _read_until_closed(raw)
    assert not answer.startswith(b"HTTP/"), answer[:80]  # at most a TLS alert record, never a response
    assert httpx.get(tls_server.url + "/v2/health/live", verify=_trusting(pki)).status_code == 200  # still serving


def _read_until_closed(raw: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := raw.recv(4096):
            chunks.append(chunk)
    except ConnectionResetError:
        pass  # the server dropped the connection: what a refused handshake looks like too
    return b"".join(chunks)


def test_with_ssl_ca_certs_only_clients_with_a_certificate_from_that_ca_are_served(gpt_run, pki):  # noqa: F811
    server = Server(gpt_run, *_tls_args(pki, clients=True), verify=_trusting(pki, "client"))
    try:
        for refused in (_trusting(pki), _trusting(pki, "stranger")):  # no certificate; one from another CA
            with pytest.raises(httpx.TransportError):
                httpx.get(server.url + "/v2/health/live", verify=refused, timeout=10)
        assert httpx.get(server.url + "/v2/health/live", verify=_trusting(pki, "client")).status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                               http_client=openai.DefaultHttpxClient(verify=_trusting(pki, "client")))
        text = client.completions.create(model="gpt-tiny", prompt="a", max_tokens=3, temperature=0).choices[0].text
        assert len(text.encode("utf-8", errors="surrogatepass")) >= 1
    finally:
        _, out = server.stop()
    assert f"at https://127.0.0.1:{server.port}" in out and "client certificate required" in out, out


def test_sigterm_with_an_idle_pooled_client_and_a_stream_in_flight_exits_at_once(gpt_run, pki):  # noqa: F811
    server = Server(gpt_run, *_tls_args(pki), verify=_trusting(pki))
    idle = httpx.Client(verify=_trusting(pki))  # a keep-alive connection left in the pool: it never says goodbye
    assert idle.get(server.url + "/v2/health/live").status_code == 200
    lines, stopped = [], None
    with httpx.stream("POST", server.url + "/v1/completions", verify=_trusting(pki), timeout=60,
                      json={"model": "gpt-tiny", "prompt": "d", "max_tokens": 30, "temperature": 0,
                            "stream": True}) as answer:
        for line in answer.iter_lines():
            if stopped is None:
                server.proc.send_signal(signal.SIGTERM)
                stopped = time.monotonic()
            lines.append(line)
    code = server.proc.wait(timeout=60)
    took = time.monotonic() - stopped
    idle.close()
    assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]", lines[-3:]
    # Before idle TLS connections were dropped at shutdown, asyncio waited 30 s for the pooled client's close_notify.
    assert code in (0, -signal.SIGTERM) and took < 10, (code, took)


@pytest.mark.parametrize("flags, said", [
    (["--ssl-certfile", "server.pem", "--ssl-keyfile", "missing.key"], "--ssl-keyfile missing.key: no such file"),
    (["--ssl-certfile", "server.pem"], "--ssl-certfile needs --ssl-keyfile"),
    (["--ssl-certfile", "not-a-certificate.pem", "--ssl-keyfile", "server.key"],
     "--ssl-certfile not-a-certificate.pem holds no PEM certificate"),
])
def test_bad_tls_files_are_one_line_and_exit_2(pki, tmp_path, flags, said):
    done = run_cli("serve", str(tmp_path), "--port", str(_free_port()), *flags, cwd=pki, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert said in done.stderr, done.stderr


@pytest.mark.parametrize("cert, key, ca, said", [
    ("server.pem", "client.key", None, "is not the key of"),
    ("server.pem", "not-a-certificate.pem", None, "does not load as the private key"),
    ("server.key", "server.key", None, "holds no PEM certificate"),
    (None, "server.key", None, "needs --ssl-certfile"),
    (None, None, "ca.pem", "--ssl-ca-certs asks clients"),
    ("server.pem", "server.key", "server.key", "--ssl-ca-certs .*server.key holds no PEM certificate"),
    ("server.pem", "server.key", "missing.pem", "--ssl-ca-certs .*missing.pem: no such file"),
])
def test_check_names_the_bad_tls_input(pki, cert, key, ca, said):
    from gpudl.errors import UserError
    from gpudl.serve.server import ServeOptions, check

    def at(name):
        return str(pki / name) if name else None
    with pytest.raises(UserError, match=said):
        check(ServeOptions(ssl_certfile=at(cert), ssl_keyfile=at(key), ssl_ca_certs=at(ca)))
    assert check(ServeOptions(ssl_certfile=at("server.pem"), ssl_keyfile=at("server.key"), ssl_ca_certs=at("ca.pem"))) \
        is None


def test_an_encrypted_key_is_refused_instead_of_prompted_for(pki, tmp_path):
    from gpudl.errors import UserError
    from gpudl.serve.server import ServeOptions, check

    _openssl("pkey", "-in", str(pki / "server.key"), "-aes256", "-passout", "pass:secret", "-out", "locked.key",
             cwd=tmp_path)
    with pytest.raises(UserError, match="is encrypted"):
        check(ServeOptions(ssl_certfile=str(pki / "server.pem"), ssl_keyfile=str(tmp_path / "locked.key")))


def test_a_key_sent_off_loopback_without_tls_gets_one_note(pki):
    from gpudl.serve.server import ServeOptions, clear_text_note

    assert "clear text" in clear_text_note(ServeOptions(host="0.0.0.0"), "k")
    assert clear_text_note(ServeOptions(host="0.0.0.0", ssl_certfile="server.pem", ssl_keyfile="server.key"),
                           "k") is None
    assert clear_text_note(ServeOptions(host="127.0.0.1"), "k") is None
