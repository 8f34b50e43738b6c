"""The out-of-memory report: each fix's predicted saving against the saving measured on real steps
(benchmarks/memory_measure.py: c10's allocation log, no code shared with the estimate), and the
report where nothing fits."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import measured_once
from gpudl import models
from gpudl.config import load_config
from gpudl.memory.fake_jobs import estimate
from gpudl.memory.oom import fixes, fixes_line
from gpudl.memory.plan import local_machine, plan
from gpudl.memory.report import why

_PATH = Path(__file__).parents[2] / "benchmarks" / "memory_measure.py"
_spec = importlib.util.spec_from_file_location("memory_measure", _PATH)
mm = sys.modules.setdefault("memory_measure", importlib.util.module_from_spec(_spec))
if not hasattr(mm, "measure"):
    _spec.loader.exec_module(mm)

ASKED = mm.Case("gpt-tiny", 32)  # fp32, one process
FIXED = {  # each fix as the measured job it makes
    "bf16-mixed": mm.Case("gpt-tiny", 32, "bf16-mixed"),
    "activation checkpointing": mm.Case("gpt-tiny", 32, activation_checkpointing=True),
    "selective activation checkpointing": mm.Case("gpt-tiny", 32, activation_checkpointing="selective"),
    "micro-batch 32 -> 16": mm.Case("gpt-tiny", 16, overrides=(("train.grad_accum", 2),)),
    "FSDP over 2 processes": mm.Case("gpt-tiny", 32, strategy="fsdp", world=2),
}


def measured_peak(case, tmp_path: Path) -> int:
    return max(r["peak_bytes"] for r in measured_once(mm, case, tmp_path / case.title.replace(" ", "_")))


def test_each_fix_saves_what_it_predicts_within_15_percent(tmp_path):
    cfg = load_config(None, ASKED.config_sets())
    found = {f.name: f for f in fixes(cfg, 1, estimate(cfg))}
    assert set(found) == set(FIXED)
    asked = measured_peak(ASKED, tmp_path)
    for name, case in FIXED.items():
        saved = asked - measured_peak(case, tmp_path)
        assert found[name].saving == pytest.approx(saved, rel=0.15), (name, found[name].saving / 2**20, saved / 2**20)
    line = fixes_line(sorted(found.values(), key=lambda f: -f.saving))
    assert line.startswith("activation checkpointing -") and "bf16-mixed -" in line  # largest saving first


def test_where_nothing_fits_the_report_gives_the_breakdown_and_the_fixes():
    cfg = load_config(None, [*ASKED.config_sets(), "model.n_layer=2", "train.batch_size=8"])
    n = sum(p.numel() for p in models.build_meta(models.resolve("gpt-tiny", {"n_layer": 2})).parameters())
    result = plan(cfg, local_machine("cpu", 1, limit=int(n * 16 * 1.02)))  # just above weights + grads + AdamW
    said = why(result)
    assert result.winner is None and said.startswith("Nothing fits in")
    assert "predicted peak per process" in said and "fixes, by predicted saving: " in said and "bf16-mixed -" in said


def test_on_an_accelerator_cpu_offload_is_a_fix_worth_the_training_state():
    """Where host memory is apart from the device's, FSDP's CPU offload is offered: it takes AdamW's
    moments (8 bytes a parameter), the gradients and the weights but those a block gathers back off
    the device: more than the moments, less than all 16 bytes a parameter of fp32 training. On the
    CPU, one memory, it saves nothing and is not offered."""
    sets = [*ASKED.config_sets(), "model.n_layer=2", "train.batch_size=8"]
    n = sum(p.numel() for p in models.build_meta(models.resolve("gpt-tiny", {"n_layer": 2})).parameters())
    on_cpu = load_config(None, sets)
    assert "FSDP CPU offload" not in {f.name for f in fixes(on_cpu, 1, estimate(on_cpu))}
    on_gpu = load_config(None, [*sets, "run.device=cuda"])
    offload = {f.name: f for f in fixes(on_gpu, 1, estimate(on_gpu))}["FSDP CPU offload"]
    assert offload.sets == ("parallel.fsdp_cpu_offload=true",) and 8 * n < offload.saving < 16 * n
