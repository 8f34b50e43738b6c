"""`serve_load.py --tls`: what TLS costs `gpudl serve`, http and https side by side in one run.

The batching server twice, over plain HTTP and over HTTPS (a throwaway self-signed P-256 certificate
made by the openssl command), both running with the same --threads, the load sent to one then the
other in ABBA order for --rounds rounds, so that drift on a busy machine falls on both alike.
Printed per round: throughput, p50, p99, and the CPU time a request cost the server and the
clients; per point: https's p50 over http's (the medians' ratio, and the median of the rounds'
ratios with a bootstrap interval), p99, throughput and CPU.
"""

from __future__ import annotations

import asyncio
import os
import random
import ssl
import statistics
import subprocess
import sys
from pathlib import Path


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 and its key, made by the openssl command."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def _same_threads(folder: Path, args) -> int:
    """--threads, else the count `gpudl serve` would measure, found here once: two servers measuring
    each for itself could choose differently, and the comparison would be of thread counts."""
    if args.threads:
        return args.threads
    from gpudl.device.discovery import usable_cpus
    from gpudl.serve.load import load_model
    from gpudl.serve.threads import choose_threads, full_batch_call

    return choose_threads(full_batch_call(load_model(folder, device=args.device), 32), usable_cpus())[0]


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system, Linux's /proc): what a round cost the server,
    which other work on a shared machine disturbs far less than it does latency. NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compare_tls(kind: str, folder: Path, name: str, args, tmp: Path, *, start, load, port,
                request_for) -> list[dict]:
    """The batching server over http and over https, both running, each point's load sent to one then
    the other in ABBA order; p50 and p99 per round, and https's p50 over http's. `start`, `load`,
    `port` and `request_for`: serve_load.py's, so that both scripts measure alike."""
    cert, key = self_signed(tmp)
    trust = ssl.create_default_context(cafile=str(cert))
    threads = _same_threads(folder, args)
    servers, rows = {}, []
    try:
        for scheme, extra in (("http", []), ("https", ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])):
            number = port()
            url = f"{scheme}://127.0.0.1:{number}"
            argv = [sys.executable, "-m", "gpudl", "serve", str(folder), "--port", str(number), "--device", args.device,
                    "--threads", str(threads), *extra]
            servers[scheme] = (start(argv, url, trust), url)
        path, body, units = request_for(kind, name, "batching")
        for c in args.concurrency:
            for scheme in ("http", "https"):  # untimed: the first seconds of a server run slower (allocator, caches)
                asyncio.run(load(servers[scheme][1], path, body, units, c, min(args.seconds, 4.0), trust))
            for i in range(args.rounds):
                for scheme in (("http", "https") if i % 2 == 0 else ("https", "http")):
                    proc, url = servers[scheme]
                    cpu = _cpu_s(proc.pid)
                    r = asyncio.run(load(url, path, body, units, c, args.seconds, trust))
                    r["server_cpu_ms"] = 1e3 * (_cpu_s(proc.pid) - cpu) / max(r["answered"], 1)  # per request
                    rows.append({"model": kind, "server": scheme, "concurrency": c, "round": i, "threads": threads,
                                 **r})
                    print(f"{kind:6} {scheme:5} c={c:<3} round {i}  {r['throughput']:9.1f} "
                          f"{'img/s' if kind == 'resnet' else 'tok/s'}  p50 {r['p50_ms']:8.1f} ms  "
                          f"p99 {r['p99_ms']:8.1f} ms  server CPU {r['server_cpu_ms']:6.2f} ms a request  "
                          f"errors {r['errors']}", flush=True)
            _tls_summary([r for r in rows if r["concurrency"] == c], kind, c, threads)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    return rows


def _tls_summary(rows: list[dict], kind: str, c: int, threads: int) -> None:
    by = {scheme: [r for r in rows if r["server"] == scheme] for scheme in ("http", "https")}

    def median(scheme: str, field: str) -> float:
        return statistics.median(r[field] for r in by[scheme])
    added = median("https", "p50_ms") / median("http", "p50_ms") - 1
    pairs = [b["p50_ms"] / a["p50_ms"] - 1 for a, b in zip(by["http"], by["https"])]  # rounds i: same ABBA block
    low, high = _bootstrap_median(pairs)
    print(f"{kind} at concurrency {c} ({threads} server threads): median p50 https {median('https', 'p50_ms'):.1f} ms, "
          f"http {median('http', 'p50_ms'):.1f} ms: TLS adds {100 * added:+.1f}%; round by round "
          f"{', '.join(f'{100 * d:+.1f}%' for d in pairs)}: median {100 * statistics.median(pairs):+.1f}% "
          f"(95% bootstrap interval {100 * low:+.1f}% to {100 * high:+.1f}%); "
          f"p99 https {median('https', 'p99_ms'):.1f} ms, http {median('http', 'p99_ms'):.1f} ms; "
          f"throughput https/http {median('https', 'throughput') / median('http', 'throughput'):.3f}; server CPU "
          f"a request https {median('https', 'server_cpu_ms'):.2f} ms, http {median('http', 'server_cpu_ms'):.2f} ms; "
          f"clients' CPU https {median('https', 'client_cpu_ms'):.2f} ms, http {median('http', 'client_cpu_ms'):.2f} ms",
          flush=True)


def _bootstrap_median(values: list[float], draws: int = 5000) -> tuple[float, float]:
    """A 95% interval for the median of `values` (resampled with replacement, fixed seed): how far
    the round-to-round noise of a shared machine leaves the figure uncertain."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]
