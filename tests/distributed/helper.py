"""Start a test body in N real processes on one machine, joined by a file-based rendezvous.

Every process gets RANK / WORLD_SIZE / LOCAL_RANK like torchrun gives them, joins the
process group itself (Gloo on the CPU, NCCL when the test asks for GPUs), runs
`bodies.<name>(**kwargs)` and saves what it returns. On a timeout every process is killed and
the test fails with each one's output: a distributed test can fail, never hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def backends() -> list:
    """Gloo always; NCCL as well where two or more GPUs are present (skipped, with the reason, elsewhere)."""
    nccl = pytest.param("nccl", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="NCCL bodies need two or more CUDA GPUs; this machine has none"))
    return ["gloo", nccl]


def _output(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else "(no output)"


def run_ranks(body: str, world: int, tmp_path: Path, backend: str = "gloo", timeout: float = 180,
              env: dict | None = None, expect_failure: bool = False, **kwargs) -> list:
    """Run `bodies.<body>(**kwargs)` on `world` ranks; returns each rank's return value (torch.load'ed).

    With `expect_failure`, returns [(exit status, output)] per rank instead of failing the test.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    init = tmp_path / "rendezvous"
    init.unlink(missing_ok=True)
    procs, logs = [], []
    for rank in range(world):
        log = tmp_path / f"rank{rank}.log"
        penv = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world), "GPUDL_TEST_INIT": f"file://{init}", "GPUDL_TEST_BACKEND": backend,
                "OMP_NUM_THREADS": "1"}
        args = [sys.executable, str(HERE / "_worker.py"), body, json.dumps(kwargs), str(tmp_path / f"rank{rank}.pt")]
        with open(log, "w") as out:
            procs.append(subprocess.Popen(args, env=penv, stdout=out, stderr=subprocess.STDOUT,
                                          cwd=tmp_path, start_new_session=True))
        logs.append(log)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(5)  # let the others report their side of the failure, then stop them
            break
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if expect_failure:
        return [(p.returncode, _output(log)) for p, log in zip(procs, logs)]
    if failed:
        detail = "\n".join(f"--- rank {r} (exit {procs[r].returncode}) ---\n{_output(logs[r])}" for r in range(world))
        what = f"timed out after {timeout:.0f} s (ranks {hung} still running, killed)" if hung else f"ranks {failed} failed"
        pytest.fail(f"{body} on {world} {backend} processes {what}:\n{detail}", pytrace=False)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
