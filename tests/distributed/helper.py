"""Start a test body in N real processes on one machine, joined by a file-based rendezvous.

Every process gets RANK / WORLD_SIZE / LOCAL_RANK like torchrun gives them, joins the
process group itself (Gloo on the CPU; on an accelerator the collective library torch ships for
it, NCCL on CUDA and ROCm, XCCL on XPU, one device per rank), runs `bodies.<name>(device=...,
**kwargs)` and saves what it returns. On a timeout every process is killed and the test fails with
each one's output: a distributed test can fail, never hang. A test on the accelerator is skipped,
with the reason, where there are fewer accelerators than ranks.

On the CPU each rank is forked from a fork server that has imported torch and gpudl once per test
session (multiprocessing's "forkserver": a fresh interpreter, never this pytest process), instead of
a new interpreter that imports them again: about 3 s of one core less per rank. Each is still a
process of its own, in a session of its own, joining the group by the same rendezvous and running
the same `_worker.py`; its torch threads are the one OMP_NUM_THREADS=1 gives. Accelerator ranks
start as new interpreters, as before (no process that may fork has touched a device).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).parent


def backend_for(device: str, offload: bool = False) -> str:
    """The process-group backend for ranks on `device`: Gloo on the CPU, else torch's own for the device,
    with Gloo beside it for a job with FSDP's CPU offload (its gradients' norm is reduced on the host)."""
    if device == "cpu":
        return "gloo"
    own = dist.get_default_backend_for_device(device)
    return f"cpu:gloo,{device}:{own}" if offload else own


def need_devices(device: str, world: int) -> None:
    """Skip, with the reason, a test of `world` ranks on an accelerator this machine has fewer of than ranks
    (call it before any reference run, so that a skipped test costs nothing)."""
    if device == "cpu":
        return  # processes share the CPU
    have = torch.accelerator.device_count()
    if have < world:
        pytest.skip(f"{world} ranks on {device} need {world} devices, one per rank; this machine has {have}")
    try:
        backend_for(device)
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"torch ships no collective backend for {device}: {e}")


def tolerance(device: str) -> float:
    """How close a parallel run and one process on the full batch must be. On the CPU, 1e-5: float
    sums in another order. On an accelerator, 1e-4: NCCL's ring and tree all-reduces sum in yet
    other orders, and GEMMs tile a batch of 4 and one of 8 differently."""
    return 1e-5 if device == "cpu" else 1e-4


def gpudl_joins() -> dict[str, str]:
    """The environment of ranks that join through gpudl's own rendezvous (a store rank 0 hosts at
    MASTER_ADDR:MASTER_PORT), not a group the helper makes for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"GPUDL_TEST_GPUDL_JOINS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


# What the fork server imports once, so that a rank forked from it starts with it done (_preload.py).
PRELOAD = ["_preload"]
_forkserver = None


def _fork_server():
    global _forkserver
    if _forkserver is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        # Python 3.11's fork server is not given this process's sys.path (it starts as `python -c`), so it
        # finds _preload.py and bodies.py here through PYTHONPATH, set for its start alone.
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *([before] if before else [])])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
        _forkserver = context
    return _forkserver


def _forked_rank(args: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked process: what `Popen(args, env=env, cwd=cwd, stdout=log, stderr=STDOUT,
    start_new_session=True)` gives a new interpreter, then `_worker.py` run as its main script."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # OpenMP read the variable when the fork server started
    sys.argv = args[1:]
    runpy.run_path(args[1], run_name="__main__")


class _Forked:
    """A rank forked from the fork server, answering as the Popen it stands in for."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, log: Path):
        self.process = _fork_server().Process(target=_forked_rank, args=(args, env, str(cwd), str(log)))
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode


def _output(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else "(no output)"


def run_ranks(body: str, world: int, tmp_path: Path, device: str = "cpu", timeout: float = 180,
              env: dict | None = None, expect_failure: bool = False, alone: bool = False, **kwargs) -> list:
    """Run `bodies.<body>(device=device, **kwargs)` on `world` ranks, each on its own device of that type (the
    CPU: shared); returns each rank's return value (torch.load'ed).

    With `expect_failure`, returns [(exit status, output)] per rank instead of failing the test.
    `alone`: one process with no rank environment and no group made for it (`gpudl train` without torchrun).
    """
    need_devices(device, world)
    backend = backend_for(device, offload="parallel.fsdp_cpu_offload=true" in kwargs.get("sets", []))
    kwargs["device"] = device
    tmp_path.mkdir(parents=True, exist_ok=True)
    init = tmp_path / "rendezvous"
    init.unlink(missing_ok=True)
    procs, logs = [], []
    for rank in range(world):
        log = tmp_path / f"rank{rank}.log"
        penv = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world), "GPUDL_TEST_INIT": f"file://{init}", "GPUDL_TEST_BACKEND": backend,
                "GPUDL_TEST_DEVICE": device, "OMP_NUM_THREADS": "1"}
        if alone:
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                penv.pop(key)
        args = [sys.executable, str(HERE / "_worker.py"), body, json.dumps(kwargs), str(tmp_path / f"rank{rank}.pt")]
        if device == "cpu":
            procs.append(_Forked(args, penv, tmp_path, log))
        else:
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
