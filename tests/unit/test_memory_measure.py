"""The measurement side of the memory benchmark (benchmarks/memory_measure.py), checked against
allocations whose sizes are known and against a training step whose held bytes are counted by hand."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

_PATH = Path(__file__).parents[2] / "benchmarks" / "memory_measure.py"
_spec = importlib.util.spec_from_file_location("memory_measure", _PATH)
mm = sys.modules.setdefault("memory_measure", importlib.util.module_from_spec(_spec))
if not hasattr(mm, "measure"):
    _spec.loader.exec_module(mm)

# A one-block GPT small enough that a process's start is most of its cost.
SMALL = (("n_layer", 1), ("d_model", 32), ("n_head", 2), ("block_size", 16))
BATCH = 4


def small_gpt_by_hand(vocab=256, d=32, layers=1, block=16, mlp=4) -> tuple[int, int]:
    """(parameters, parameter tensors) of gpudl's GPT without biases, embeddings tied."""
    per_block = 2 * d + 4 * d * d + 2 * mlp * d * d          # two LayerNorm weights, wq wk wv wo, fc and proj
    return vocab * d + block * d + layers * per_block + d, 2 + 8 * layers + 1


def test_running_sum_bookkeeping():
    # (time, signed bytes), given out of order: before the window 100 live; inside +50, +30, -50, +10.
    deltas = [(5, 100), (12, 30), (10, 50), (13, -50), (20, 10), (31, -100), (30, 999)]
    got = mm.live_bytes(deltas, start=10, end=20)
    assert got == {"baseline_bytes": 100, "peak_bytes": 180, "end_bytes": 140, "step_peak_bytes": 80}
    # A window in which nothing happens: the live bytes at its start throughout.
    assert mm.live_bytes(deltas, 6, 9) == {"baseline_bytes": 100, "peak_bytes": 100, "end_bytes": 100,
                                           "step_peak_bytes": 0}


def test_profiler_window_moves_by_exactly_a_tensors_storage():
    seen_by_thread = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        before = torch.empty(1000, dtype=torch.float32)                    # 4000 B, before the window
        with record_function("memory_measure/step2"):
            a = torch.empty(3, 5, dtype=torch.float64)                     # 120 B
            view = a.t()[1:]                                               # a view: no allocation
            b = torch.empty(12345, dtype=torch.uint8)                      # 12345 B: the exact request
            del b                                                          # peak was 4000 + 120 + 12345
            worker = threading.Thread(target=lambda: seen_by_thread.append(torch.empty(50_000, dtype=torch.uint8)))
            worker.start()
            worker.join()
        assert mm.storage_bytes([a, view, a]) == 120
        # Freed while profiled, so that no block this test allocated stays known to c10's reporter.
        del before, a, view
    deltas, marks = mm.profiler_deltas(prof)
    got = mm.live_bytes(deltas, *marks["memory_measure/step2"])
    assert got == {"baseline_bytes": 4000, "peak_bytes": 4000 + 120 + 12345, "end_bytes": 4000 + 120,
                   "step_peak_bytes": 120 + 12345}
    # The finding that makes "c10-log" the default: another thread's 50 kB never shows up.
    assert 50_000 not in [n for _, n in deltas]
    seen_by_thread.clear()


def test_c10_log_sees_every_thread(tmp_path):
    log = mm.C10AllocationLog(tmp_path / "c10.log")
    log.start()
    try:
        before = torch.empty(1000, dtype=torch.float32)
        log.mark("begin")
        a = torch.empty(3, 5, dtype=torch.float64)
        held = []
        worker = threading.Thread(target=lambda: held.append(torch.empty(50_000, dtype=torch.uint8)))
        worker.start()
        worker.join()
        b = torch.empty(12345, dtype=torch.uint8)
        del b, held[:]
        log.mark("end")
        # Freed while the log is on, so that no block this test allocated stays known to c10.
        del before, a
    finally:
        log.stop()
    assert log.window("begin", "end") == {"baseline_bytes": 4000, "peak_bytes": 4000 + 120 + 50_000 + 12345,
                                          "end_bytes": 4000 + 120, "step_peak_bytes": 120 + 50_000 + 12345}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return mm.measure(mm.Case("gpt-tiny", BATCH, overrides=SMALL), tmp_path_factory.mktemp("single"), timeout=120)[0]


def test_held_bytes_of_a_training_step_by_hand(single):
    params, tensors = small_gpt_by_hand()
    weights_and_moments = 3 * 4 * params + 4 * tensors    # fp32 weights, exp_avg, exp_avg_sq; a 4-byte step each
    batch = BATCH * (16 + 1) * 8                           # int64 tokens: x and y are views of one (B, T+1) tensor
    assert single["held_bytes"] == weights_and_moments
    # Between steps: what the job holds and the batch the loader has made ahead; nothing else.
    assert single["baseline_bytes"] == single["end_bytes"] == weights_and_moments + batch
    # At some moment of the step every gradient exists, and the loader has made the next batch.
    assert single["peak_bytes"] >= single["baseline_bytes"] + 4 * params + batch
    assert single["step_peak_bytes"] == single["peak_bytes"] - single["baseline_bytes"]


def test_profiler_agrees_with_c10_log_on_one_process(single, tmp_path):
    by_profiler = mm.measure(mm.Case("gpt-tiny", BATCH, overrides=SMALL), tmp_path, timeout=120, method="profiler")[0]
    for key in ("baseline_bytes", "peak_bytes", "end_bytes", "held_bytes"):
        assert by_profiler[key] == single[key], key


def test_ddp_holds_one_more_copy_of_the_gradients(single, tmp_path):
    ranks = mm.measure(mm.Case("gpt-tiny", BATCH, strategy="ddp", world=2, overrides=SMALL), tmp_path, timeout=120)
    params, _ = small_gpt_by_hand()
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:  # DDP's buckets: every gradient, fp32, kept between steps (grads are views into them)
        assert r["held_bytes"] == single["held_bytes"]
        assert r["baseline_bytes"] - single["baseline_bytes"] == 4 * params


def test_case_config_and_failure_reporting(tmp_path):
    sets = mm.Case("gpt-tiny", 8, strategy="pp", world=2, overrides=(("block_size", 64),)).config_sets()
    assert {"parallel.pp=2", "model.tie_embeddings=false", "parallel.pp_microbatches=2", "model.block_size=64",
            "train.compile=false", "train.attention=sdpa", "data.kind=synthetic"} <= set(sets)
    with pytest.raises(ValueError, match="world=2"):
        mm.Case("gpt-tiny", 8, world=2)
    # A rank that does not finish in time is killed (its whole process group), and measure() raises.
    killed = r"timed out after 0.5 s \(ranks \[0\] killed\)[\s\S]*--- rank 0 \(exit -9\)"
    with pytest.raises(RuntimeError, match=killed):
        mm.measure(mm.Case("gpt-tiny", 2, overrides=SMALL), tmp_path, timeout=0.5)
