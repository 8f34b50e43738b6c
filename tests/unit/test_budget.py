"""A run sized by time: the steps that fit in `train.time_budget_s`, decided once and kept on resume."""

from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import pytest
from rich.console import Console

from gpudl.config import load_config
import gpudl.run.budget as budget_module
from gpudl.run.recipe import train

QUIET = Console(quiet=True)
SMALL = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.block_size=32", "train.batch_size=4",
         "train.eval_every=0", "train.log_every=1", "sample.tokens=0", "checkpoint.export=false",
         "log.progress=false", "train.precision=fp32", "optim.warmup_steps=3", "run.device=cpu"]
STEP_S = 0.05  # what the budget's clock says a step takes (a loaded machine cannot change the decision)


@pytest.fixture(autouse=True)
def steady_clock(monkeypatch):
    """The budget reads a clock that advances STEP_S per step: the decision is budget / STEP_S steps
    whatever else runs on the machine; what is tested is what the run does with the decision."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(budget_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * STEP_S))


def test_the_budget_decides_the_steps_and_the_schedule_ends_with_them(tmp_path):
    cfg = load_config(None, [*SMALL, "train.max_steps=5000", "train.time_budget_s=1.5", f"run.dir={tmp_path}",
                             "run.name=timed"])
    run = train(cfg, console=QUIET)
    steps = run.summary["steps"]
    saved = load_config(run.run_dir / "config.toml")
    assert steps == int(1.5 / STEP_S) and saved.train.max_steps == steps and saved.train.time_budget_s == 0
    train_records = [r for r in run.records if r["kind"] == "train"]
    lr = cfg.optim.lr
    # the cosine ends at the decided last step: its floor (min_lr_ratio x lr), not somewhere midway
    progress = (steps - 1 - 3) / (steps - 3)  # the last step's lr is the schedule's at step - 1
    assert train_records[-1]["lr"] == pytest.approx(lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))),
                                                    rel=1e-6)
    assert [r["step"] for r in train_records] == list(range(1, steps + 1))


def test_a_resumed_budgeted_run_is_the_run_that_was_decided(tmp_path):
    """Resumed after the decision (step 20) from its folder alone: the same length, bit for bit the same losses."""
    cfg = load_config(None, [*SMALL, "train.max_steps=5000", "train.time_budget_s=3", f"run.dir={tmp_path}",
                             "run.name=timed", "checkpoint.every=21", "checkpoint.keep=50", "model.dropout=0.1"])
    first = train(cfg, console=QUIET)
    decided = first.summary["steps"]
    for later in sorted((first.run_dir / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(later)  # as if the run had been stopped after step 21
    again = train(load_config(first.run_dir / "config.toml"), resume=first.run_dir, console=QUIET)
    losses = {r["step"]: r["loss"] for r in first.records if r["kind"] == "train"}
    assert again.summary["steps"] == decided == int(3 / STEP_S)
    assert {r["step"]: r["loss"] for r in again.records if r["kind"] == "train"} == \
        {s: v for s, v in losses.items() if s > 21}


def test_no_budget_without_enough_steps_to_time(tmp_path):
    cfg = load_config(None, [*SMALL, "train.max_steps=15", "train.time_budget_s=0.001", f"run.dir={tmp_path}"])
    assert train(cfg, console=QUIET).summary["steps"] == 15
