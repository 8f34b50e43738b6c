"""`serve_load.py --overload`: does `gpudl serve` hold under overload, and share fairly?

First the rated load: requests per second that `gpudl serve` (batching, its defaults) sustains with
--rated-concurrency clients in a closed loop (each sends its next request when its last is
answered; 64: every decode slot busy and as many requests waiting, or a full batch waiting while
one runs, so that no gap between a client's answer and its next request leaves the model idle), the
best of two such runs (other work on a shared machine only ever lowers it). Then open loops (clients that send at their
own Poisson rates whatever the answers, as independent users do; a refusal is counted, not
retried) with two clients of unequal weight, one sending 30x the other's requests, told apart by
`X-Tenant`: at 1x the rated load, at 2x, and the light client alone at its 2x rate (for three
times as long: it sends few requests, and a p99 needs samples). Printed per
point: throughput, p50 and p99 of the admitted requests, the refused fraction (429), errors (any
other status or a failed connection), and each client's share of the answers and its p99. Then the
goals: at 2x, the admitted requests' p99 within 2x their p99 at 1x, no error other than the
refusal, and the light client's p99 within 2x what it gets alone.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time

WEIGHTS = {"heavy": 30, "light": 1}   # requests sent per client, relative


class Connections:
    """HTTP/1.1 keep-alive connections to one server, spoken bare: on the server's own two cores a
    load generator must cost far less a request than httpx (about a millisecond of CPU each), or at
    2x the rated load it measures its own lag. Enough of the protocol for gpudl serve's answers
    (a status line, headers, a Content-Length body)."""

    def __init__(self, port: int):
        self.port, self.idle = port, []

    async def post(self, path: str, content: bytes, tenant: str) -> int | str:
        """The answer's status, or why there was none. A kept connection the server has closed
        meanwhile (uvicorn closes one idle for 5 s), found closed or reset before any answer, is
        retried once on a new one, as HTTP clients do; on a new connection that is an error."""
        if self.idle:
            status = await self._post(self.idle.pop(), path, content, tenant)
            if status != "closed":
                return status
        try:
            connection = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError as e:
            return type(e).__name__
        return await self._post(connection, path, content, tenant)

    async def _post(self, connection, path: str, content: bytes, tenant: str) -> int | str:
        reader, writer = connection
        try:
            writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Tenant: %s\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (path.encode(), tenant.encode(), len(content), content))
            line = await reader.readline()
        except (ConnectionResetError, BrokenPipeError):
            line = b""  # closed by the server before it read the request: as an end of stream
        try:
            if not line:
                writer.close()
                return "closed"
            status, length, close = int(line.split()[1]), 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                length = int(value) if name.lower() == b"content-length" else length
                close = close or (name.lower() == b"connection" and value.strip().lower() == b"close")
            await reader.readexactly(length)
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
            writer.close()
            return type(e).__name__
        if close:
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


def _record(clients: dict, name: str, status: int | str, seconds: float) -> None:
    c = clients[name]
    if status == 200:
        c["latencies"].append(seconds)
    elif status == 429:
        c["refused"] += 1
    else:
        c["errors"] += 1
        c["why"][str(status)] = c["why"].get(str(status), 0) + 1


async def closed_loop(port: int, path: str, body: dict, units: int, concurrency: int, seconds: float) -> dict:
    """`concurrency` clients, each sending its next request when its last is answered."""
    content, http = json.dumps(body).encode(), Connections(port)
    clients = {"closed": {"latencies": [], "sent": 0, "refused": 0, "errors": 0, "why": {}}}
    t0 = time.monotonic()

    async def client() -> None:
        while time.monotonic() < t0 + seconds:
            clients["closed"]["sent"] += 1
            began = time.monotonic()
            _record(clients, "closed", await http.post(path, content, "closed"), time.monotonic() - began)
    await asyncio.gather(*(client() for _ in range(concurrency)))
    http.close()
    return _summary(clients, units, time.monotonic() - t0, seconds)


async def open_loop(port: int, path: str, body: dict, units: int, rates: dict[str, float], seconds: float,
                    seed: int = 0) -> dict:
    """Each client sends at its Poisson rate (requests/s) for `seconds`, with its name as X-Tenant."""
    content, http = json.dumps(body).encode(), Connections(port)  # encoded once
    clients = {name: {"latencies": [], "sent": 0, "refused": 0, "errors": 0, "why": {}} for name in rates}
    pending: list[asyncio.Task] = []

    async def one(name: str) -> None:
        began = time.monotonic()
        _record(clients, name, await http.post(path, content, name), time.monotonic() - began)

    async def send(name: str, rate: float, rng: random.Random, end: float) -> None:
        at = time.monotonic()
        while (at := at + rng.expovariate(rate)) < end:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            clients[name]["sent"] += 1
            pending.append(asyncio.ensure_future(one(name)))

    t0 = time.monotonic()
    await asyncio.gather(*(send(n, r, random.Random(f"{seed}-{n}"), t0 + seconds) for n, r in rates.items()))
    await asyncio.gather(*pending)
    http.close()
    return _summary(clients, units, time.monotonic() - t0, seconds)


def _p(latencies: list[float], q: int) -> float:
    return 1e3 * statistics.quantiles(latencies, n=100)[q - 1] if len(latencies) > 1 else float("nan")


def _summary(clients: dict, units: int, took: float, seconds: float) -> dict:
    """Throughput over the time to the last answer; the rate sent over the time spent sending."""
    every = [x for c in clients.values() for x in c["latencies"]]
    sent = sum(c["sent"] for c in clients.values())
    out = {"throughput": len(every) * units / took, "sent_per_s": sent / seconds, "p50_ms": _p(every, 50),
           "p99_ms": _p(every, 99), "refused": sum(c["refused"] for c in clients.values()) / max(sent, 1),
           "errors": sum(c["errors"] for c in clients.values()), "clients": {}, "why": {}}
    for c in clients.values():  # what the errors were: a status, or the connection's exception
        for k, n in c["why"].items():
            out["why"][k] = out["why"].get(k, 0) + n
    for name, c in clients.items():
        out["clients"][name] = {"sent": c["sent"], "share": len(c["latencies"]) / max(len(every), 1),
                                "p99_ms": _p(c["latencies"], 99), "refused": c["refused"] / max(c["sent"], 1)}
    return out


def overload(kind: str, folder, name: str, args, *, start, port, request_for) -> list[dict]:
    """The rated load, then the open-loop points, on one `gpudl serve` (serve_load.py's helpers passed in)."""
    p = port()
    url = f"http://127.0.0.1:{p}"
    argv = [sys.executable, "-m", "gpudl", "serve", str(folder), "--port", str(p), "--device", args.device]
    argv += ["--threads", str(args.threads)] if args.threads else []
    argv += ["--max-wait-s", str(args.max_wait_s)] if args.max_wait_s is not None else []
    proc = start(argv, url)
    unit = "img/s" if kind == "resnet" else "tok/s"
    rows = []
    try:
        path, body, units = request_for(kind, name, "batching")
        rated = max((asyncio.run(closed_loop(p, path, body, units, args.rated_concurrency, args.seconds))
                     for _ in range(2)), key=lambda r: r["throughput"])
        rps = rated["throughput"] / units
        rows.append({"model": kind, "server": "overload", "point": "rated (closed loop)",
                     "concurrency": args.rated_concurrency, **rated})
        print(f"{kind:6} rated load: {rps:.1f} requests/s ({rated['throughput']:.1f} {unit}) with "
              f"{args.rated_concurrency} clients in a closed loop, p99 {rated['p99_ms']:.1f} ms, "
              f"errors {rated['errors']}{_why(rated)}", flush=True)
        light_2x = 2 * rps * WEIGHTS["light"] / sum(WEIGHTS.values())
        points = [("1x rated", _split(rps), 1), ("2x rated", _split(2 * rps), 1),
                  ("light alone", {"light": light_2x}, 3)]
        for i, (label, rates, longer) in enumerate(points):
            r = asyncio.run(open_loop(p, path, body, units, rates, longer * args.seconds, seed=i))
            rows.append({"model": kind, "server": "overload", "point": label, "offered_per_s": sum(rates.values()),
                         **r})
            _print_point(kind, label, sum(rates.values()), r, unit)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    _goals(kind, {r["point"]: r for r in rows})
    return rows


def _split(total: float) -> dict[str, float]:
    return {n: total * w / sum(WEIGHTS.values()) for n, w in WEIGHTS.items()}


def _print_point(kind: str, label: str, offered: float, r: dict, unit: str) -> None:
    per_client = " | ".join(f"{n}: sent {c['sent']}, {100 * c['share']:.1f}% of the answers, p99 {c['p99_ms']:.1f} ms, "
                            f"refused {100 * c['refused']:.1f}%" for n, c in r["clients"].items())
    print(f"{kind:6} {label:11} offered {offered:6.1f} req/s (sent {r['sent_per_s']:.1f}/s): "
          f"{r['throughput']:8.1f} {unit}  admitted p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  "
          f"refused {100 * r['refused']:.1f}%  errors {r['errors']}{_why(r)}  [{per_client}]", flush=True)


def _why(r: dict) -> str:
    return f" ({', '.join(f'{k}: {n}' for k, n in r['why'].items())})" if r["errors"] else ""


def _goals(kind: str, at: dict) -> None:
    one, two, alone = at["1x rated"], at["2x rated"], at["light alone"]
    p99 = two["p99_ms"] / one["p99_ms"]
    light = two["clients"]["light"]["p99_ms"] / alone["clients"]["light"]["p99_ms"]
    loaded = two["clients"]["light"]["p99_ms"] / one["clients"]["light"]["p99_ms"]
    errors = sum(at[k]["errors"] for k in ("1x rated", "2x rated", "light alone"))
    print(f"{kind} goals: admitted p99 at 2x / at 1x = {p99:.2f} (<= 2: {'met' if p99 <= 2 else 'missed'}); "
          f"errors other than 429: {errors} (0: {'met' if errors == 0 else 'missed'}); light client's p99 at 2x / "
          f"alone = {light:.2f} (<= 2: {'met' if light <= 2 else 'missed'}); beside it, the light client's p99 at "
          f"2x / at 1x (the same full batches, half the offered load) = {loaded:.2f}", flush=True)
