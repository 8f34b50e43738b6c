"""Ctrl-C and preemption: the step finishes, a checkpoint is written, and resuming loses nothing.

Real processes, real signals: `gpudl train` is started, signalled at a random step once its
metrics show it got there, and resumed; the losses must equal an uninterrupted run's, bit for bit.
(Two ranks through the launcher: tests/distributed/test_launch.py.)
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, run_cli
from gpudl.checkpoint import complete_checkpoints

LONG = [*TINY, "train.max_steps=300", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
        "model.dropout=0.1", "sample.tokens=0", "checkpoint.export=false"]


def sets(*items: str) -> list[str]:
    return [a for item in (*LONG, *items) for a in ("--set", item)]


def train_losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def logged_steps(run: Path) -> int:
    try:
        return sum('"train"' in line for line in (run / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def signal_at(proc: subprocess.Popen, run: Path, step: int, signum: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while logged_steps(run) < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be signalled"
    proc.send_signal(signum)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    root = tmp_path_factory.mktemp("reference")
    out = run_cli("train", *sets(f"run.dir={root}", "run.name=ref"), cwd=root)
    assert out.returncode == 0, out.stderr
    return train_losses(root / "ref")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_and_resuming_is_bit_identical(tmp_path, reference, signum):
    step = random.randint(20, 150)
    run = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "gpudl", "train", *sets(f"run.dir={tmp_path}", "run.name=cut")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    signal_at(proc, run, step, signum)
    out, err = proc.communicate(timeout=120)
    stopped = int(out.split("Stopped at step ")[1].split()[0]) if "Stopped at step " in out else None
    assert proc.returncode == 128 + signum, (step, out[-2000:], err[-2000:])
    assert stopped is not None and step <= stopped < 300, (step, out[-2000:])
    assert f"Resume with: gpudl train --resume {run}" in out and "Traceback" not in err
    assert f"{signal.Signals(signum).name}: finishing this step" in err
    assert logged_steps(run) == stopped  # every step up to the stop is in the metrics
    assert (run / "checkpoints" / f"step_{stopped:08d}").is_dir()
    resumed = run_cli("train", "--resume", str(run), cwd=tmp_path)
    assert resumed.returncode == 0 and f"Resuming at step {stopped}" in resumed.stdout, resumed.stderr
    assert train_losses(run) == reference, f"signalled at step {step}, stopped at {stopped}"


def test_a_second_signal_stops_at_once(tmp_path):
    run = tmp_path / "twice"
    slow = ["train.batch_size=64", "model.block_size=128", "model.d_model=128", "train.max_steps=100000"]
    proc = subprocess.Popen([sys.executable, "-m", "gpudl", "train", *sets(f"run.dir={tmp_path}", "run.name=twice",
                                                                              "checkpoint.every=0", *slow)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    signal_at(proc, run, 3, signal.SIGINT)
    # Python runs a handler only between bytecodes: a second signal sent while the step is still in
    # C++ would merge with the first. Send it once the handler has said it ran.
    for line in proc.stderr:
        if "finishing this step" in line:
            break
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT  # ended by the signal itself, not by a finished step
    assert complete_checkpoints(run / "checkpoints") == []
