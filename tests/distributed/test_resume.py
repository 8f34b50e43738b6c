"""Resuming on another number of processes than saved the checkpoint, both ways, data-parallel and sharded.

A run is cut into segments on 1, 2 and 4 processes, each resuming the one before, always at the
same global batch (8 rows a step: batch k is a pure function of (seed, k), so any number of
data-parallel ranks sees exactly the rows of one process). Every segment's losses and the final
weights must be those of one process training the whole run uninterrupted; the state a segment
restores must be the very state the one before it saved; a weights-only load (optimizer=None) at
another world size must give the saved weights. The model has no dropout, so no loss depends on
the random streams, which are re-seeded (from run.seed, the rank and the step) where the world
size changes; each rank's re-seeded stream is checked apart.
"""

from __future__ import annotations

import pytest
import torch

from rich.console import Console

from bodies import on, resume_on_this_world
from gpudl.checkpoint.streams import derived_seed
from gpudl.config import load_config
from gpudl.run.recipe import train
from helper import run_ranks, tolerance

GLOBAL_BATCH = 8
SEED = 7
# Each segment stops at its own max_steps, so the lr must not depend on it: a warm-up over the first two
# segments (restored across their boundary), then the peak (no cosine, whose length is max_steps).
SCHEDULE = ["optim.warmup_steps=4", "optim.min_lr_ratio=1.0"]


def run_sets(world: int, steps: int) -> list[str]:
    """What every run here shares, at `world` processes' share of the global batch, stopping at `steps`."""
    return [f"run.seed={SEED}", *SCHEDULE, "train.eval_every=0", f"train.max_steps={steps}",
            f"train.batch_size={GLOBAL_BATCH // world}"]


def segment_sets(tmp_path, world: int, steps: int, layout: str) -> list[str]:
    """One segment's settings: `steps` is where it stops; `layout` the data-parallel degree's key."""
    return [*run_sets(world, steps), f"run.dir={tmp_path}/runs", "run.name=cut", "checkpoint.every=2",
            "checkpoint.export=false", *([f"{layout}={world}"] if world > 1 else [])]


def segment(tmp_path, world: int, steps: int, layout: str, first: bool = False) -> dict:
    """A segment on `world` processes (1: in this process), resuming the run unless it is the first;
    rank 0's report."""
    sets = segment_sets(tmp_path, world, steps, layout)
    resume = None if first else f"{tmp_path}/runs/cut"
    if world == 1:
        return resume_on_this_world(sets, resume=resume, weights_only=resume is not None)
    ranks = run_ranks("resume_on_this_world", world, tmp_path / f"w{world}-s{steps}", timeout=300, sets=sets,
                      resume=resume, weights_only=True)
    rngs = [r["rng"] for r in ranks]
    assert all(not torch.equal(rngs[0], other) for other in rngs[1:]), "ranks must draw different random numbers"
    return {**ranks[0], "rngs": rngs}


def uninterrupted(tmp_path, steps: int) -> dict:
    """One process training all `steps` on the global batch: what every segmented run must reproduce."""
    result = train(load_config(None, on("cpu", [*run_sets(1, steps), f"run.dir={tmp_path}/ref", "run.name=ref"])),
                   console=Console(quiet=True))
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "params": {k: v.detach() for k, v in result.model.state_dict().items()}}


def same_state(a: dict, b: dict) -> None:
    """Bit for bit: what was saved is what is restored, whichever number of processes saved and restored it."""
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[k][field]), torch.as_tensor(sb[k][field])), (k, field)
    assert [g["lr"] for g in a["optim"]["param_groups"]] == [g["lr"] for g in b["optim"]["param_groups"]]


def reseeded(rank: int, step: int) -> torch.Tensor:
    """The CPU generator's state after seeding it as the docs say a re-seeded rank is."""
    return torch.Generator().manual_seed(derived_seed(SEED, rank, step)).get_state()


def check_chain(tmp_path, worlds: list[int], layout: str) -> None:
    """Segments of 2 steps on each of `worlds` in turn, against the uninterrupted run of all the steps."""
    total = 2 * len(worlds)
    want = uninterrupted(tmp_path, total)
    tol = tolerance("cpu")
    before = None
    for i, world in enumerate(worlds):
        got = segment(tmp_path, world, 2 * (i + 1), layout, first=i == 0)
        if before is not None:
            same_state(before, got["restored"])
            if "weights_only" in got:
                assert all(torch.equal(got["weights_only"][k], v) for k, v in before["params"].items())
            if "rngs" in got:
                assert all(torch.equal(rng, reseeded(r, 2 * i)) for r, rng in enumerate(got["rngs"]))
            saved_by = f"{worlds[i - 1]} process{'es' if worlds[i - 1] > 1 else ''}"
            assert got["printed"].count(f"The checkpoint was saved by {saved_by} and resumes on {world}: random "
                                        f"streams (dropout) are re-seeded") == 1, got["printed"]
        steps = range(2 * i + 1, 2 * i + 3)
        assert sorted(got["losses"]) == list(steps), f"segment {i} on {world} processes"
        for s in steps:
            assert got["losses"][s] == pytest.approx(want["losses"][s], abs=tol), \
                f"loss at step {s}, on {world} processes after {worlds[i - 1] if i else 0}"
        before = got
    for name, p in want["params"].items():
        assert torch.allclose(before["params"][name], p, atol=tol, rtol=0), name


@pytest.mark.slow
def test_ddp_resumes_from_1_to_2_to_4_to_1_processes(tmp_path):
    check_chain(tmp_path, [1, 2, 4, 1], "parallel.dp_replicate")


@pytest.mark.slow
def test_fsdp_resumes_from_1_to_4_to_2_to_1_processes(tmp_path):
    """4 -> 2 -> 1 with FSDP's shards resharded by DCP, and then trained on, against one process."""
    check_chain(tmp_path, [1, 4, 2, 1], "parallel.dp_shard")
