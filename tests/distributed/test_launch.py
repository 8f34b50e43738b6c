"""The launcher for real: torchrun agents started by `gpudl train`, workers killed, two "nodes"."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bodies import TINY

SETS = [a for item in TINY for a in ("--set", item)]


def gpudl(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpudl", "train", *SETS, *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):  # workers live in sessions of their own
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"gpudl train did not finish in {timeout} s:\n{out[-4000:]}", pytrace=False)
    assert proc.returncode == 0, out[-4000:]
    return out


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes_exactly(tmp_path):
    long = ["--set", "train.max_steps=300", "--set", "checkpoint.every=20", "--set", "train.eval_every=0"]
    ref = gpudl("--nproc-per-node", "2", *long, "--set", f"run.dir={tmp_path}", "--set", "run.name=ref",
                cwd=tmp_path)
    finish(ref)
    job = gpudl("--nproc-per-node", "2", "--max-restarts", "1", *long, "--set", f"run.dir={tmp_path}",
                "--set", "run.name=killed", cwd=tmp_path)
    first = tmp_path / "killed" / "checkpoints" / "step_00000020"
    deadline = time.monotonic() + 120
    while not first.exists() and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    workers = children(job.pid)
    assert first.exists() and len(workers) == 2, "the run ended before a worker could be killed"
    os.kill(workers[1], signal.SIGKILL)
    out = finish(job)
    assert "Resuming at step" in out
    assert losses(tmp_path / "killed") == losses(tmp_path / "ref")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_agents_on_loopback_form_one_job(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [gpudl("--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                   "--set", f"run.dir={tmp_path}", "--set", "run.name=two", cwd=tmp_path) for _ in range(2)]
    outs = [finish(n) for n in nodes]
    assert any("over 2 processes" in o for o in outs)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["samples_per_s"] > 0
