"""Runs under gpudl's enforced memory limit (the CPU's live-bytes count): a run that does not fit
recovers by halving its micro-batch and trains as one that started with it; a planned run fits.

The limits are set from the estimator's own predictions (within 0.3% of the measured peaks for
these jobs: benchmarks/memory_accuracy.py), halfway between two micro-batch sizes, so the test
does not hard-code what a torch version allocates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from gpudl.config import load_config
from gpudl.memory.fake_jobs import estimate

GPT = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.block_size=64", "train.precision=fp32",
       "train.max_steps=5", "train.log_every=1", "train.eval_every=0", "sample.tokens=0", "log.progress=false",
       "log.plot=false", "train.time_budget_s=0", "checkpoint.export=false", "train.attention=sdpa",
       "run.device=cpu"]  # the CPU's limit (live bytes) on any machine


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def sets(*items: str) -> list[str]:
    return [a for item in (*GPT, *items) for a in ("--set", item)]


def peak(*items: str) -> int:
    return estimate(load_config(None, [*GPT, *items])).peak


def test_a_run_over_its_limit_recovers_as_if_it_had_started_with_half_the_micro_batch(tmp_path):
    limit = (peak("train.batch_size=32") + peak("train.batch_size=16", "train.grad_accum=2")) // 2
    over = run_cli("train", *sets(f"run.dir={tmp_path}", "run.name=over", "train.batch_size=32"),
                   "--memory-limit", f"{limit}B", cwd=tmp_path)
    assert over.returncode == 0, over.stderr[-3000:]
    half = run_cli("train", *sets(f"run.dir={tmp_path}", "run.name=half", "train.batch_size=16", "train.grad_accum=2"),
                   cwd=tmp_path)
    assert half.returncode == 0, half.stderr[-3000:]
    ooms = records(tmp_path / "over", "oom")
    assert [(o["micro_batch"], o["halved_to"]) for o in ooms] == [(32, 16)], ooms
    assert "CPU out of memory" in ooms[0]["error"]
    got = [r["loss"] for r in records(tmp_path / "over", "train")]
    want = [r["loss"] for r in records(tmp_path / "half", "train")]
    assert got == pytest.approx(want, abs=1e-5)


def test_the_planned_run_fits_under_the_limit_it_was_planned_for(tmp_path):
    limit = int(peak("train.batch_size=32") * 0.6)
    out = run_cli("train", "--plan", "auto", "--memory-limit", f"{limit}B",
                  *sets(f"run.dir={tmp_path}", "run.name=planned", "train.batch_size=32"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Plan: " in out.stdout and records(tmp_path / "planned", "oom") == []
    cfg = load_config(tmp_path / "planned" / "config.toml")
    assert cfg.train.plan == "off" and cfg.train.batch_size * cfg.train.grad_accum == 32  # the global batch is kept
    assert cfg.train.batch_size < 32 or cfg.train.activation_checkpointing


def test_a_limit_that_is_not_a_size_is_one_line(tmp_path):
    out = run_cli("train", "--memory-limit", "twelve", *sets(f"run.dir={tmp_path}"), cwd=tmp_path)
    assert out.returncode == 2 and "train.memory_limit 'twelve' is not a size" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()
