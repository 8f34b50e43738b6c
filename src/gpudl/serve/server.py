"""Run `gpudl serve`: check what was asked, start listening, load the model, serve, stop gracefully.

The server listens before the model has loaded: liveness answers at once and readiness says 503
until the weights are on the device, as an orchestrator expects of a server whose model takes a
while to load. On SIGTERM or Ctrl-C uvicorn stops accepting connections and waits up to
`grace_s` for the requests in flight (streams included) to finish; then the engine stops, after
answering what it still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from ..errors import UserError
from .guard import Guard, api_key_for, is_loopback
from .tls import check_tls, uvicorn_server, uvicorn_ssl


@dataclass(frozen=True)
class ServeOptions:
    path: str | None = None           # a run folder or an export; None: the newest run under ./runs
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    precision: str = "auto"
    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    max_queue: int = 256
    max_wait_s: float = 0.5           # admit a request only if it can start within this (0: up to max_queue wait)
    api_key: str | None = None
    request_timeout_s: float = 60.0
    max_body_bytes: int = 64 * 2**20
    grace_s: float = 30.0
    name: str | None = None           # what clients call the model (default: the preset's name, e.g. gpt-tiny)
    threads: int | None = None        # CPU only: torch's intra-op threads; None: measured at start (threads.py)
    ssl_certfile: str | None = None   # TLS: the server's certificate (PEM); with ssl_keyfile, https only
    ssl_keyfile: str | None = None    # TLS: its private key (PEM, unencrypted)
    ssl_ca_certs: str | None = None   # TLS: clients must present a certificate signed by this CA (PEM)


def check(options: ServeOptions) -> str | None:
    """What can be refused before anything starts, in one line each; the API key requests must carry."""
    if not 0 < options.port < 65536:
        raise UserError(f"--port {options.port} is not a TCP port: use 1-65535 (8000 by default)")
    if options.max_batch_size < 1 or options.max_queue_delay_ms < 0 or options.max_queue < 1 \
            or options.request_timeout_s <= 0 or (options.threads is not None and options.threads < 1) \
            or not options.max_wait_s >= 0:
        raise UserError("--max-batch-size, --max-queue and --threads must be >= 1, --max-queue-delay-ms and "
                        "--max-wait-s >= 0 and --request-timeout-s > 0")
    if options.path is not None and not Path(options.path).exists():
        raise UserError(f"{options.path!r} does not exist: give a run folder (runs/...) or a folder that "
                        f"`gpudl export` wrote")
    check_tls(options.ssl_certfile, options.ssl_keyfile, options.ssl_ca_certs)
    return api_key_for(options.host, options.api_key)


def clear_text_note(options: ServeOptions, key: str | None) -> str | None:
    """One line when a key guards a server that other machines reach without TLS: anyone on the path
    can read the key (and the prompts) off the wire."""
    if key is None or options.ssl_certfile or is_loopback(options.host):
        return None
    return ("Note: without TLS the API key and every request cross the network in clear text: add "
            "--ssl-certfile and --ssl-keyfile, or serve behind a TLS proxy")


def serve(options: ServeOptions, console: Console) -> int:
    key = check(options)
    note = clear_text_note(options, key)
    if note:
        console.print(note, markup=False, soft_wrap=True)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UserError(f"gpudl serve needs {e.name}: pip install 'gpudl[serve]'") from None
    from .app import Served, create_app

    served = Served(name="(loading)", request_timeout_s=options.request_timeout_s,
                    max_body_bytes=options.max_body_bytes, key_required=key is not None)
    failed: list[str] = []
    app = create_app(served, lifespan=_lifespan(served, options, console, failed))
    config = uvicorn.Config(Guard(app, key, options.max_body_bytes), host=options.host, port=options.port,
                            log_level="warning", timeout_graceful_shutdown=options.grace_s, lifespan="on",
                            **uvicorn_ssl(options.ssl_certfile, options.ssl_keyfile, options.ssl_ca_certs))
    server = uvicorn_server(config)
    served.server = server
    server.run()
    if failed:
        raise UserError(failed[0])
    return 0


def _lifespan(served, options: ServeOptions, console: Console, failed: list[str]):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(_load(served, options, console, failed))
        yield
        task.cancel()
        if served.engine is not None:
            await served.engine.stop(timeout_s=options.grace_s)
    return lifespan


async def _load(served, options: ServeOptions, console: Console, failed: list[str]) -> None:
    from .load import load_model
    from .metrics import Metrics

    try:
        loaded = await asyncio.to_thread(load_model, options.path, options.device, options.precision)
    except UserError as e:
        failed.append(str(e))
        served.server.should_exit = True
        return
    loaded.name = options.name or loaded.name  # what clients call it: the preset's name unless --name
    served.name, served.loaded = loaded.name, loaded
    engine = make_engine(loaded, max_batch_size=options.max_batch_size,
                         max_queue_delay_ms=options.max_queue_delay_ms, max_queue=options.max_queue,
                         max_wait_s=options.max_wait_s or None)
    if loaded.kind == "onnx":  # torch's thread count is not onnxruntime's: it sizes its own pool to the cores
        served.threads = "onnxruntime's own threads"
    elif loaded.device.type == "cpu":  # before the engine starts: its KV cache serves the timed call
        served.threads = await asyncio.to_thread(_cpu_threads, loaded, options, getattr(engine, "cache", None))
    served.metrics = Metrics(served.name, engine)  # sets the engine's hooks: before it starts
    engine.start()
    served.engine = engine
    console.print(_started_line(served, options), markup=False, soft_wrap=True)


def _started_line(served, options: ServeOptions) -> str:
    scheme = "https" if options.ssl_certfile else "http"
    loaded, address = served.loaded, f"{scheme}://{options.host}:{options.port}"
    endpoints = [f"/v2/models/{served.name}/infer"]
    if loaded.kind == "gpt":
        endpoints += ["/v1/completions", "/v1/chat/completions"]
    key = " · API key required" if served.key_required else ""
    key += " · client certificate required" if options.ssl_ca_certs else ""
    threads = f" ({served.threads})" if served.threads else ""
    return (f"Serving {served.name} ({loaded.describe}) on {loaded.device_label}{threads} at {address} · "
            f"{' · '.join(endpoints)} · /v2/health/ready · /metrics{key}")


def _cpu_threads(loaded, options: ServeOptions, cache=None) -> str:
    """Set torch's intra-op threads for a model served on the CPU; says how many and why."""
    import torch

    from ..device.discovery import usable_cpus
    from .threads import choose_threads, full_batch_call

    cores = usable_cpus()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
        return f"{options.threads} of {cores} CPU threads, as asked"
    try:
        chosen, _ = choose_threads(full_batch_call(loaded, options.max_batch_size, cache), cores)
    except Exception as e:  # noqa: BLE001 -- a failed measurement must not keep the model from serving
        torch.set_num_threads(cores)
        return f"{cores} CPU threads: measuring failed ({type(e).__name__})"
    return f"{chosen} of {cores} CPU threads, measured"


def make_engine(loaded, *, max_batch_size: int = 32, max_queue_delay_ms: float = 5.0, max_queue: int = 256,
                max_wait_s: float | None = None):
    """The engine for a model from `load.load_model`: dynamic batching for a classifier (and a fit run's
    model.onnx), continuous
    batching with a KV cache for a GPT. Not started: call `start()`. `max_wait_s`: admit a request
    only if it can start within it (`gpudl serve` gives 0.5 s; None: up to `max_queue` wait)."""
    if loaded.kind == "gpt":
        from .generation import GenerationEngine

        return GenerationEngine(loaded.model, loaded.device, tokenizer=loaded.tokenizer, max_batch_size=max_batch_size,
                                max_queue=max_queue, max_wait_s=max_wait_s)
    from .batching import BatchingEngine

    return BatchingEngine(loaded.model, loaded.device, max_batch_size=max_batch_size,
                          max_queue_delay_ms=max_queue_delay_ms, max_queue=max_queue,
                          input_shape=loaded.input_shape, input_name=loaded.inputs[0].name, max_wait_s=max_wait_s)
