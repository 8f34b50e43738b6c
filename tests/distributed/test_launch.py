"""The launcher for real: torchrun agents started by `gpudl train`, workers killed, two "nodes"."""

from __future__ import annotations

import json
import os
import random
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


LONG = ["--set", "train.max_steps=300", "--set", "checkpoint.every=20", "--set", "train.eval_every=0",
        "--set", "train.log_every=1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of an uninterrupted two-process run of the LONG settings."""
    root = tmp_path_factory.mktemp("reference")
    finish(gpudl("--nproc-per-node", "2", *LONG, "--set", f"run.dir={root}", "--set", "run.name=ref", cwd=root))
    return losses(root / "ref")


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes_exactly(tmp_path, reference):
    job = gpudl("--nproc-per-node", "2", "--max-restarts", "1", *LONG, "--set", f"run.dir={tmp_path}",
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
    assert losses(tmp_path / "killed") == reference


@pytest.mark.slow
def test_a_signalled_launch_saves_and_resumes_with_its_own_config(tmp_path, reference):
    """SIGINT to the launcher (Ctrl-C): the agent passes it on, both ranks stop after one agreed step and save;
    `--resume` through the launcher then reads the run's config.toml, not the default recipe."""
    run = tmp_path / "cut"
    job = gpudl("--nproc-per-node", "2", *LONG, "--set", f"run.dir={tmp_path}", "--set", "run.name=cut",
                cwd=tmp_path)
    step = random.randint(25, 150)
    deadline = time.monotonic() + 120
    while (len(losses(run)) if (run / "metrics.jsonl").exists() else 0) < step and time.monotonic() < deadline \
            and job.poll() is None:
        time.sleep(0.01)
    job.send_signal(signal.SIGINT)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGINT and "Traceback" not in out, out[-4000:]
    stopped = max(losses(run))
    assert step <= stopped < 300 and (run / "checkpoints" / f"step_{stopped:08d}").is_dir(), out[-4000:]
    assert f"Stopped by SIGINT: the newest checkpoint is step {stopped}. Resume with: gpudl train " \
           f"--nproc-per-node 2 --resume {run}" in out
    config = (run / "config.toml").read_text()
    resumed = subprocess.run([sys.executable, "-m", "gpudl", "train", "--nproc-per-node", "2", "--resume", str(run)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0 and f"Resuming at step {stopped}" in resumed.stdout, resumed.stdout[-4000:]
    assert (run / "config.toml").read_text() == config  # no --set given: the run's config is left as it was
    assert losses(run) == reference, f"signalled at step {step}, stopped at {stopped}"


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
