"""A deep GPT's estimate from traces of 4 and 5 blocks (memory/depth.py) equals the trace of the whole model."""

import pytest

from gpudl.config import load_config, with_sets
from gpudl.memory.depth import SHALLOW, extrapolate
from gpudl.memory.estimate import traced_here
from gpudl.memory.fake_jobs import FakeJobs
from gpudl.memory.trace import at_peak

DEEP = 9  # more blocks than the shallow traces have, few enough to trace whole quickly


def _tiny(*sets: str):
    # fixed kernel and precision: "auto" would time real kernels on this CPU first
    fixed = [f"model.n_layer={DEEP}", "data.kind=synthetic", "train.attention=sdpa", "train.precision=fp32"]
    return with_sets(load_config("gpt-tiny"), [*fixed, *sets])


@pytest.fixture(scope="module")
def jobs_of_four():
    with FakeJobs(4, workers=1) as shallow, FakeJobs(4, whole=True, workers=1) as whole:
        yield shallow, whole


@pytest.mark.parametrize("sets", [
    ("parallel.dp_replicate=4", "train.batch_size=8", "train.grad_accum=2"),
    ("parallel.dp_replicate=4", "train.batch_size=4", "train.activation_checkpointing=true",
     "train.precision=bf16-mixed"),
    ("parallel.dp_shard=4", "train.batch_size=8"),
    ("parallel.dp_shard=4", "train.batch_size=4", "train.grad_accum=2", "parallel.fsdp_reshard_after_forward=false"),
    ("parallel.dp_replicate=2", "parallel.dp_shard=2", "train.batch_size=4", "train.activation_checkpointing=true"),
    ("parallel.tp=4", "train.batch_size=4", "parallel.tp_sequence_parallel=true"),
    ("parallel.tp=2", "parallel.dp_shard=2", "train.batch_size=4", "train.grad_accum=2"),
], ids=["ddp-accumulating", "ddp-checkpointing-bf16", "fsdp", "fsdp-no-reshard", "hsdp-checkpointing",
        "tp-sequence-parallel", "tp-x-fsdp"])
def test_extrapolated_estimate_equals_the_whole_trace(jobs_of_four, sets):
    shallow, whole = jobs_of_four
    cfg = _tiny("parallel.dp_replicate=1", "parallel.dp_shard=1", "parallel.tp=1", *sets)
    fast, full = shallow.estimate(cfg), whole.estimate(cfg)
    assert fast.parts == full.parts  # byte for byte, category by category
    assert full.peak > 0


def test_one_process_estimate_extrapolated_equals_the_whole_trace():
    cfg = _tiny("train.batch_size=4", "train.grad_accum=2", "train.precision=bf16-mixed")
    with FakeJobs(1) as shallow, FakeJobs(1, whole=True) as whole:
        assert shallow.estimate(cfg).parts == whole.estimate(cfg).parts


def test_the_peak_moves_with_depth_and_the_pieces_follow_it():
    """Here the deep model's peak is where its forward ends, inside autocast (which caches a
    low-precision copy of every block's weights), while the shallow ones peak later: extrapolating
    the peak's total gets the deep model wrong; extrapolating each piece of the step does not."""
    cfg = _tiny("train.precision=bf16-mixed", "train.batch_size=4", "train.grad_accum=2",
                "train.activation_checkpointing=true")
    traces = {n: traced_here(with_sets(cfg, [f"model.n_layer={n}"]), 1) for n in (*SHALLOW, DEEP)}
    total = {n: sum(at_peak(t).values()) for n, t in traces.items()}
    steps = DEEP - SHALLOW[0]
    naive = total[SHALLOW[0]] + steps * (total[SHALLOW[1]] - total[SHALLOW[0]])
    assert naive < total[DEEP]  # the trap: a total extrapolated misses the moved peak
    assert at_peak(extrapolate(traces[SHALLOW[0]], traces[SHALLOW[1]], steps)) == at_peak(traces[DEEP])


def test_traces_whose_pieces_do_not_match_are_refused():
    cfg = _tiny("train.batch_size=4", "train.grad_accum=2")
    accumulating = traced_here(with_sets(cfg, ["model.n_layer=4"]), 1)
    whole_batch = traced_here(with_sets(cfg, ["model.n_layer=5", "train.grad_accum=1"]), 1)  # one micro-batch
    with pytest.raises(RuntimeError, match="differ in their pieces"):
        extrapolate(accumulating, whole_batch, 3)
