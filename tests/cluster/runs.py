"""What the cluster tier's jobs share: a small GPT run's settings, its command line, and reading its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# gpt-tiny, narrowed: 2 layers of 32, batch 4 per process, 10 steps, the checkpoint at step 5
RUN = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.block_size=32", "train.batch_size=4",
       "train.max_steps=10", "train.log_every=1", "train.eval_every=0", "train.precision=fp32",
       "train.compile=false", "train.time_budget_s=0", "sample.tokens=0", "log.progress=false", "log.plot=false",
       "checkpoint.every=5", "run.device=cpu"]
# One thread per process on either side: the same kernels, so the same sums in the same order.
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
PORT = 29531


def gpudl(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpudl", *args]


def train_argv(run_dir: Path, *launch: str) -> list[str]:
    sets = [f"--set={s}" for s in [*RUN, f"run.dir={run_dir.parent}", f"run.name={run_dir.name}"]]
    return gpudl("train", *launch, *sets)


def train_alone(run_dir: Path, processes: int, sets: tuple[str, ...] = ()) -> Path:
    """The run on this machine alone, with `processes` processes: the reference a job over hosts is held to."""
    argv = train_argv(run_dir, "--nproc-per-node", str(processes)) + [f"--set={s}" for s in sets]
    done = subprocess.run(argv, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if r["kind"] == "train"}


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{log.name} still running after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        assert code == 0, f"{log.name} exited {code}:\n{log.read_text()[-3000:]}"


def newest_checkpoint(run_dir: Path) -> int:
    done = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    return max(done, default=0)
