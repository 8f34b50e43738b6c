"""checkpoint.async: a save is copied at its step and written while training goes on.

The writes are held up where a test needs them in flight by a storage writer of the test's own:
DCP's FileSystemWriter, which waits before it writes one checkpoint's files (a slow disk). The
processes, files and signals are real. (Two ranks with FSDP: tests/distributed/test_faults.py.)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch.distributed.checkpoint import FileSystemWriter

from conftest import TINY, run_here
from gpudl.checkpoint import Checkpointer, complete_checkpoints
from gpudl.checkpoint.background import BackgroundWriter, _tensors, choose
from gpudl.checkpoint.files import verify
from gpudl.config import load_config
from gpudl.errors import UserError
from gpudl.training.loop import TrainState

GiB = 2**30


def test_the_key_is_async_in_toml_and_on_the_command_line(tmp_path):
    assert load_config(None).checkpoint.async_save == "auto"
    assert load_config(None, ["checkpoint.async=true"]).checkpoint.async_save is True
    recipe = tmp_path / "r.toml"
    recipe.write_text("[checkpoint]\nasync = false\n")
    cfg = load_config(recipe)
    assert cfg.checkpoint.async_save is False
    assert "\nasync = false\n" in cfg.to_toml() and "async_save" not in cfg.to_toml()
    with pytest.raises(UserError, match=r"checkpoint.async must be bool \| 'auto', got 'maybe'"):
        load_config(None, ["checkpoint.async=maybe"])
    with pytest.raises(UserError, match=r"unknown setting 'checkpoint.async_save'.*\[checkpoint\] has: .*async"):
        load_config(None, ["checkpoint.async_save=true"])


@pytest.mark.parametrize("asked, need, free, limit, on, words", [
    ("auto", 12 * GiB, 100 * GiB, False, True, "auto: on (12.00 GiB of host buffers"),
    ("auto", 60 * GiB, 100 * GiB, False, False, "would not fit in half the host's available memory (100.0 GiB)"),
    ("auto", 1 * GiB, None, False, False, "(unknown)"),
    ("auto", 1 * GiB, 100 * GiB, True, False, "train.memory_limit would count the host buffers"),
    (True, 60 * GiB, 100 * GiB, True, True, "checkpoint.async=true"),
    (False, 1 * GiB, 100 * GiB, False, False, "checkpoint.async=false"),
])
def test_auto_stages_where_the_buffers_fit(asked, need, free, limit, on, words):
    chosen, why = choose(asked, need, free, limit)
    assert chosen is on and words in why


class Held(FileSystemWriter):
    """DCP's own writer, which waits for `gate` before it writes the files of a folder whose name holds `hold`."""

    gate = threading.Event()
    hold = "step_00000003"

    def write_data(self, plan, planner):
        if Held.hold in str(self.path):
            assert Held.gate.wait(60)
        return super().write_data(plan, planner)


def _train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_background_save_holds_its_step_and_not_the_updates_after_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, opt, 3, seed=1)
    want_model = copy.deepcopy(model.state_dict())
    want_optim = copy.deepcopy(opt.state_dict())
    ckpt = Checkpointer(tmp_path, keep=2, model_fingerprint={"name": "mlp"})
    writer = BackgroundWriter(ckpt, pin=False, storage=Held)
    Held.gate.clear()
    writer.save(3, model, opt, {"train_state": dataclasses.asdict(TrainState(step=3))})
    buffers = [t.data_ptr() for _, t in _tensors(writer.stager._buffers)]
    _train(model, opt, 3, seed=2)  # in place, while the write of step 3 waits
    assert not torch.equal(model[0].weight, want_model["0.weight"])
    assert ckpt.latest() is None  # not before the write is complete
    Held.gate.set()
    writer.save(6, model, opt, {"train_state": dataclasses.asdict(TrainState(step=6))})  # after step 3's write
    assert [t.data_ptr() for _, t in _tensors(writer.stager._buffers)] == buffers  # the same buffers, reused
    writer.close()
    assert [c.name for c in complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000006"]

    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    _train(fresh, fresh_opt, 1, seed=3)  # optimizer state to load into
    assert ckpt.load(tmp_path / "step_00000003", fresh, fresh_opt)["train_state"]["step"] == 3
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want_model[k]), k
    for i, state in fresh_opt.state_dict()["state"].items():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[field], want_optim["state"][i][field]), (i, field)


# A run whose write of step 4's checkpoint is held up for argv[1] seconds (a slow disk), after it says so in a file.
HELD_RUN = """
import json, pathlib, sys, time
from torch.distributed.checkpoint import FileSystemWriter
from gpudl.checkpoint import background
from gpudl.cli import main

class Held(FileSystemWriter):
    def write_data(self, plan, planner):
        if "step_00000004" in str(self.path):
            (pathlib.Path(sys.argv[2]) / "holding").write_text("")
            time.sleep(float(sys.argv[1]))
        return super().write_data(plan, planner)

background.FileSystemWriter = Held
sys.exit(main(["train", *json.loads(sys.argv[3])]))
"""

ASYNC = [*TINY, "train.max_steps=400", "checkpoint.every=2", "checkpoint.async=true", "train.eval_every=0",
         "train.log_every=1", "sample.tokens=0", "checkpoint.export=false"]


def _held_run(tmp_path: Path, hold_s: float, *sets: str) -> tuple[subprocess.Popen, Path]:
    args = [a for item in (*ASYNC, f"run.dir={tmp_path}", "run.name=held", *sets) for a in ("--set", item)]
    proc = subprocess.Popen([sys.executable, "-c", HELD_RUN, str(hold_s), str(tmp_path), json.dumps(args)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "holding").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (tmp_path / "holding").exists(), proc.communicate()
    return proc, tmp_path / "held"


def _steps_logged(run: Path) -> int:
    return sum('"train"' in line for line in (run / "metrics.jsonl").read_text().splitlines())


def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    proc, run = _held_run(tmp_path, 600)
    deadline = time.monotonic() + 60
    while _steps_logged(run) < 5 and time.monotonic() < deadline:  # training goes on while step 4 is written
        time.sleep(0.01)
    proc.kill()
    out, _ = proc.communicate(timeout=60)
    assert _steps_logged(run) >= 5 and "Checkpoint saves: in the background (checkpoint.async=true" in out
    assert [c.name for c in complete_checkpoints(run / "checkpoints")] == ["step_00000002"]
    assert (run / "checkpoints" / "step_00000004.tmp").is_dir()  # the write that was cut, never counted
    resumed = run_here("train", "--resume", str(run), "--set", "train.max_steps=4")  # in this process: the kill was real
    assert resumed.returncode == 0 and "Resuming at step 2" in resumed.stdout, resumed.stderr[-3000:]
    assert [c.name for c in complete_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000004"]


def test_sigterm_waits_for_the_write_in_flight_then_saves_and_stops(tmp_path):
    proc, run = _held_run(tmp_path, 3)
    proc.send_signal(signal.SIGTERM)  # while step 4's files are held up
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped = int(out.split("Stopped at step ")[1].split()[0])
    assert stopped > 4
    kept = complete_checkpoints(run / "checkpoints")
    assert [c.name for c in kept] == ["step_00000004", f"step_{stopped:08d}"]
    assert all(verify(c)["train_state"]["step"] == int(c.name[5:]) for c in kept)
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_a_failed_background_write_is_one_line_and_keeps_the_previous_checkpoint(tiny, tmp_path):
    """No file may grow past 20 kB (the kernel refuses the write, as a full disk does): step 6's shards cannot be
    written on the writer's thread; the run stops at the next step with the line a blocking save gives."""
    from gpudl.run.recipe import train

    saved = train(tiny("run.name=ok", "train.max_steps=4", "checkpoint.every=2", "checkpoint.export=false"),
                  console=Console(quiet=True)).run_dir
    before = [(c.name, verify(c)) for c in complete_checkpoints(saved / "checkpoints")]
    out = subprocess.run([sys.executable, "-m", "gpudl", "train", "--resume", str(saved), "--set", "train.max_steps=60",
                          "--set", "checkpoint.async=true", "--set", "checkpoint.every=6"],
                         capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000)))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "could not write checkpoint step 6 to" in out.stderr and "file too large" in out.stderr.lower()
    assert "step_00000004, is kept" in out.stderr and f"--resume {saved}" in out.stderr
    assert [(c.name, verify(c)) for c in complete_checkpoints(saved / "checkpoints")] == before
    assert not list((saved / "checkpoints").glob("*.tmp"))
    steps = [json.loads(line)["step"] for line in (saved / "metrics.jsonl").read_text().splitlines()
             if '"train"' in line]
    assert max(steps) < 60  # reported at a step boundary after the failure, not at the end
