"""Runs under gpudl's enforced memory limit (the CPU's live-bytes count; on an accelerator its caching
allocator's memory fraction): a run that does not fit recovers by halving its micro-batch and trains
as one that started with it; a planned run fits.

The limits are set from the estimator's own predictions (within 0.3% of the measured peaks for
these jobs: benchmarks/memory_accuracy.py), halfway between two micro-batch sizes, so the test
does not hard-code what a torch version allocates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli, run_here
from gpudl.config import load_config
from gpudl.memory.fake_jobs import estimate
from gpudl.memory.plan import WORKSPACE_BYTES

GPT = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.block_size=64", "train.precision=fp32",
       "train.max_steps=5", "train.log_every=1", "train.eval_every=0", "sample.tokens=0", "log.progress=false",
       "log.plot=false", "train.time_budget_s=0", "checkpoint.export=false", "train.attention=sdpa",
       "train.compile=false",  # the estimates trace the eager step; compile is "auto", on for GPUs
       "run.device=cpu"]  # the CPU's limit (live bytes) on any machine
# On an accelerator a model whose activations are hundreds of MiB: the allocator reserves memory in
# segments of 2 and 20 MiB, which would swamp a tiny model's few MiB of peak.
ACCELERATOR = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.block_size=256"]


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def job(device: str) -> list[str]:
    return GPT if device == "cpu" else [*GPT, *ACCELERATOR, f"run.device={device}"]


def sets(device: str, *items: str) -> list[str]:
    return [a for item in (*job(device), *items) for a in ("--set", item)]


def peak(device: str, *items: str) -> int:
    return estimate(load_config(None, [*job(device), *items])).peak


def test_a_run_over_its_limit_recovers_as_if_it_had_started_with_half_the_micro_batch(tmp_path, device):
    # an accelerator's limit also holds cuBLAS's workspaces, which its allocator keeps beside the tensors
    runtime = 0 if device == "cpu" else WORKSPACE_BYTES
    limit = (peak(device, "train.batch_size=32") + peak(device, "train.batch_size=16", "train.grad_accum=2")) // 2 \
        + runtime
    over = run_cli("train", *sets(device, f"run.dir={tmp_path}", "run.name=over", "train.batch_size=32"),
                   "--memory-limit", f"{limit}B", cwd=tmp_path)
    assert over.returncode == 0, over.stderr[-3000:]
    ooms = records(tmp_path / "over", "oom")
    assert [(o["micro_batch"], o["halved_to"]) for o in ooms] == [(32, 16)], ooms
    assert ("CPU out of memory" if device == "cpu" else "out of memory") in ooms[0]["error"]
    # the reference, with no limit: in this process (conftest.run_here); the limited run above has one of its own
    half = run_here("train", *sets(device, f"run.dir={tmp_path}", "run.name=half", "train.batch_size=16",
                                   "train.grad_accum=2"))
    assert half.returncode == 0, half.stderr[-3000:]
    got = [r["loss"] for r in records(tmp_path / "over", "train")]
    want = [r["loss"] for r in records(tmp_path / "half", "train")]
    # The CPU's kernels are the same for both micro-batches; a GPU's GEMMs may differ by shape.
    assert got == pytest.approx(want, abs=1e-5 if device == "cpu" else 1e-4)


def test_the_planned_run_fits_under_the_limit_it_was_planned_for(tmp_path, device):
    limit = int(peak(device, "train.batch_size=32") * 0.6)
    out = run_cli("train", "--plan", "auto", "--memory-limit", f"{limit}B",
                  *sets(device, f"run.dir={tmp_path}", "run.name=planned", "train.batch_size=32"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Plan: " in out.stdout and records(tmp_path / "planned", "oom") == []
    cfg = load_config(tmp_path / "planned" / "config.toml")
    assert cfg.train.plan == "off" and cfg.train.batch_size * cfg.train.grad_accum == 32  # the global batch is kept
    assert cfg.train.batch_size < 32 or cfg.train.activation_checkpointing


def test_below_the_training_state_the_planned_run_offloads_to_the_host_and_fits(tmp_path, accelerator):
    """A limit under the 16 bytes a parameter of fp32 training (weights, gradients, AdamW's moments):
    no plan fits on the device alone, so the plan keeps them in host memory (FSDP's CPU offload, FSDP
    over this one process), and the run trains under the enforced limit without running out."""
    from gpudl import models

    wide = ("model.d_model=1024", "model.n_head=8", "train.batch_size=8")  # peaks of hundreds of MiB: see ACCELERATOR
    cfg = load_config(None, [*job(accelerator), *wide])
    n = sum(p.numel() for p in models.build_meta(models.resolve(cfg.model.name, cfg.model.overrides)).parameters())
    limit = WORKSPACE_BYTES + 12 * n
    out = run_cli("train", "--plan", "auto", "--memory-limit", f"{limit}B",
                  *sets(accelerator, f"run.dir={tmp_path}", "run.name=offloaded", *wide), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CPU offload" in out.stdout and records(tmp_path / "offloaded", "oom") == []
    planned = load_config(tmp_path / "offloaded" / "config.toml")
    assert planned.parallel.fsdp_cpu_offload and planned.train.batch_size * planned.train.grad_accum == 8


def test_a_limit_that_is_not_a_size_is_one_line(tmp_path):
    out = run_cli("train", "--memory-limit", "twelve", *sets("cpu", f"run.dir={tmp_path}"), cwd=tmp_path)
    assert out.returncode == 2 and "train.memory_limit 'twelve' is not a size" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()
