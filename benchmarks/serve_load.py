"""How much does batching buy `gpudl serve`? A concurrency sweep on loopback, batching on and off.

For a ResNet (Open Inference Protocol, one image a request) and a GPT (OpenAI completions, greedy,
a fixed number of tokens a request): `gpudl serve` with batching (dynamic for the ResNet,
continuous with a KV cache for the GPT), the same server with --max-batch-size 1 (one request at a
time: batch-1 serving), and beside them a plain FastAPI endpoint that calls the model once per
request (the baseline LitServe and Triton compare themselves with). Clients are asyncio tasks on
httpx, each sending its next request when its last is answered, for a fixed time per point.
Printed: throughput (images/s or tokens/s), p50 and p99 latency, errors, and the ratios the
goals are stated in (ResNet with batching >= 4x the throughput of batch-1 serving at p99 <= 2x
its latency; GPT >= 4x the tokens/s of one request at a time at 16 streams). First, for each
model, the most batching can buy on this machine: the model alone, a call of 16 and of 32 rows (a
decoding step of 16 or 32 sequences for the GPT) against a call of one, in throughput. Besides
batching over batch-1 at each concurrency, the GPT's goal ratio is printed: batching at each
concurrency over batch-1 at one.

    python benchmarks/serve_load.py                       # both models, concurrency 1 4 16 64
    python benchmarks/serve_load.py --models resnet --seconds 5 --concurrency 1 16
    python benchmarks/serve_load.py --tls --models gpt --concurrency 16   # what TLS costs: http vs https
    python benchmarks/serve_load.py --overload --models gpt --seconds 10   # 2x the rated load, two clients

With --tls, instead of the sweep: the batching server twice, over plain HTTP and over HTTPS (a
throwaway self-signed P-256 certificate made by the openssl command), both running, the load sent
to one then the other in ABBA order for --rounds rounds, so that drift on a busy machine falls on
both alike. Clients keep their connections (as OpenAI's and httpx's do), so a round pays one
handshake per client and TLS's cost is mostly the encryption of every request and answer, on both
ends (the clients run on the same machine); serve_tls.py says what is printed.

With --overload, instead of the sweep: the rated load, then open loops at 1x and 2x of it from two
clients of unequal weight (30:1), and the light one alone (serve_overload.py says how).

The models are randomly initialised (throughput does not depend on the weights' values).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

TOKENS = 32            # generated per GPT request
IMAGE = 32             # ResNet input: (1, 3, IMAGE, IMAGE)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export(kind: str, folder: Path) -> Path:
    """A randomly initialised preset, written as `gpudl export` does, with its config beside it."""
    import dataclasses

    from gpudl import models
    from gpudl.checkpoint import export_safetensors
    from gpudl.config import load_config

    sets = ["model.name=resnet18", f"data.image_size={IMAGE}", "data.kind=images"] if kind == "resnet" else \
        ["model.name=gpt-tiny"]
    cfg = load_config(None, sets)
    spec = models.from_config(cfg)
    model = models.build(spec, "cpu")
    model.init_weights()
    folder.mkdir(parents=True)
    meta = {"gpudl_model": spec.name, "config": json.dumps(dataclasses.asdict(spec.config)), "step": "0"}
    export_safetensors(model, folder / "model.safetensors", meta)
    (folder / "config.toml").write_text(cfg.to_toml())
    return folder


def start(argv: list[str], url: str, verify: ssl.SSLContext | bool = True) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2, verify=verify).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{argv} did not become ready: {proc.stderr.read()}")


def request_for(kind: str, name: str, style: str):
    """(path, JSON body, units of work an answer carries) for one request."""
    if kind == "resnet":
        body = {"inputs": [{"name": "input", "shape": [1, 3, IMAGE, IMAGE], "datatype": "FP32",
                            "data": np.random.default_rng(0).standard_normal(3 * IMAGE * IMAGE).round(3).tolist()}]}
        return (f"/v2/models/{name}/infer" if style != "plain" else "/infer"), body, 1
    body = {"model": name, "prompt": "def main():\n", "max_tokens": TOKENS, "temperature": 0}
    return ("/v1/completions" if style != "plain" else "/generate"), body, TOKENS


async def load(url: str, path: str, body: dict, units: int, concurrency: int, seconds: float,
               verify: ssl.SSLContext | bool = True) -> dict:
    latencies, errors = [], 0
    end = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient):
        nonlocal errors
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                ok = (await http.post(path, json=body)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.monotonic() - t0)
            else:
                errors += 1
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, verify=verify) as http:
        t0, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        took, cpu = time.monotonic() - t0, time.process_time() - cpu
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [float("nan")] * 99
    return {"throughput": len(latencies) * units / took, "p50_ms": 1e3 * q[49], "p99_ms": 1e3 * q[98],
            "errors": errors, "answered": len(latencies), "client_cpu_ms": 1e3 * cpu / max(len(latencies), 1)}


def ceiling(kind: str, folder: Path, device: str, batch: int = 32) -> float:
    """What batching can buy at most: the model alone, in this process, at `batch` rows (or
    sequences) a call against one, in throughput (best of 5 calls, torch's default threads)."""
    from gpudl.serve.load import load_model
    from gpudl.serve.threads import full_batch_call, seconds_per_call

    loaded = load_model(folder, device=device)
    one, full = (seconds_per_call(full_batch_call(loaded, n), repeats=5) for n in (1, batch))
    return batch * one / full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet", "gpt"], choices=["resnet", "gpt"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--seconds", type=float, default=8.0, help="per point")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cpu", help="where the servers run the model (default: cpu)")
    ap.add_argument("--threads", type=int, help="gpudl serve --threads (CPU; default: measured by the server)")
    ap.add_argument("--servers", nargs="+", default=["batching", "batch-1", "plain"],
                    choices=["batching", "batch-1", "plain"])
    ap.add_argument("--tls", action="store_true", help="instead of the sweep: the batching server over http and "
                                                       "https side by side (see above)")
    ap.add_argument("--rounds", type=int, default=4, help="--tls: rounds per protocol and point (ABBA order)")
    ap.add_argument("--overload", action="store_true", help="instead of the sweep: 1x and 2x the rated load from a "
                                                            "heavy and a light client (serve_overload.py)")
    ap.add_argument("--rated-concurrency", type=int, default=64, help="--overload: closed-loop clients that "
                                                                      "measure the rated load")
    ap.add_argument("--max-wait-s", type=float, help="--overload: gpudl serve --max-wait-s (default: the server's)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpudl-serve-load-") as tmp:
        for kind in args.models:
            folder = export(kind, Path(tmp) / kind)
            name = "resnet18" if kind == "resnet" else "gpt-tiny"
            if args.tls:
                from serve_tls import compare_tls  # beside this script

                rows += compare_tls(kind, folder, name, args, Path(tmp), start=start, load=load, port=_port,
                                    request_for=request_for)
                continue
            if args.overload:
                from serve_overload import overload  # beside this script

                rows += overload(kind, folder, name, args, start=start, port=_port, request_for=request_for)
                continue
            for rows_per_call in (16, 32):  # 16: the ceiling at 16 streams, where the GPT's goal is stated
                bound = ceiling(kind, folder, args.device, rows_per_call)
                rows.append({"model": kind, "server": "model alone", "batch": rows_per_call, "batch_over_one": bound})
                print(f"{kind:6} the model alone: a batch of {rows_per_call} gives {bound:.2f}x the throughput of "
                      f"batch 1", flush=True)
            for style in args.servers:
                port = _port()
                url = f"http://127.0.0.1:{port}"
                argv = [sys.executable, "-m", "gpudl", "serve", str(folder), "--port", str(port), "--device", args.device]
                argv += {"batching": [], "batch-1": ["--max-batch-size", "1"],
                         "plain": None}[style] or []
                argv += ["--threads", str(args.threads)] if args.threads else []
                if style == "plain":
                    argv = [sys.executable, str(Path(__file__).parent / "serve_plain.py"), str(folder), str(port), args.device]
                proc = start(argv, url)
                try:
                    path, body, units = request_for(kind, name, style)
                    for c in args.concurrency:
                        r = asyncio.run(load(url, path, body, units, c, args.seconds))
                        rows.append({"model": kind, "server": style, "concurrency": c, **r})
                        print(f"{kind:6} {style:9} c={c:<3} {r['throughput']:9.1f} {'img/s' if kind == 'resnet' else 'tok/s'}"
                              f"  p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  errors {r['errors']}", flush=True)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
    _ratios(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def _ratios(rows: list[dict]) -> None:
    at = {(r["model"], r["server"], r["concurrency"]): r for r in rows if "concurrency" in r}
    for (model, server, c), r in sorted(at.items()):
        one = at.get((model, "batch-1", c))
        if server == "batching" and one:
            print(f"{model} at concurrency {c}: batching {r['throughput'] / one['throughput']:.2f}x the throughput "
                  f"of batch-1 serving, p99 {r['p99_ms'] / one['p99_ms']:.2f}x its latency")
        alone = at.get((model, "batch-1", 1))
        if server == "batching" and alone and c > 1:
            # The goal's ratio: batch-1 serving at c > 1 refuses what cannot start within --max-wait-s,
            # so its throughput there is admission's, not one-at-a-time serving's.
            print(f"{model} at concurrency {c}: batching {r['throughput'] / alone['throughput']:.2f}x the throughput "
                  f"of batch-1 serving at concurrency 1")


if __name__ == "__main__":
    main()
