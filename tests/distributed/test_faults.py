"""Faults: a stalled rank becomes a named error, in a training step, in the checkpoint load or at the rendezvous.

(Resharding checkpoints between world sizes: test_resume.py.)"""

from __future__ import annotations

import time

from helper import gpudl_joins, run_ranks


def test_a_stalled_rank_is_named_within_the_timeout(tmp_path):
    t0 = time.monotonic()
    ranks = run_ranks("train_with_stall", 2, tmp_path, expect_failure=True, timeout=120,
                      env={"GPUDL_TEST_TIMEOUT_S": "5"},
                      sets=["parallel.dp_replicate=2", "parallel.timeout_s=5", f"run.dir={tmp_path}/runs",
                            "run.name=stall"], stall_rank=1, stall_step=3, seconds=90)
    elapsed = time.monotonic() - t0
    code, out = ranks[0]
    assert code != 0
    assert "gradient all-reduce (DDP) of step 3 timed out after 5 s on rank 0" in out
    assert "rank 1 never arrived" in out
    assert elapsed < 5 + 30 + 15  # the timeout, the 30 s the error may take, process start-up


def test_a_rank_late_for_the_checkpoint_load_is_named_within_the_timeout(tmp_path):
    """Rank 1 holds up the load's DCP read: rank 0's error names that collective, the phase and rank 1, within
    parallel.timeout_s, and never blames the checkpoint (which is intact)."""
    from bodies import resume_on_this_world
    from test_resume import segment_sets

    resume_on_this_world(segment_sets(tmp_path, 1, 2, "parallel.dp_replicate"))  # the checkpoint, by one process
    t0 = time.monotonic()
    ranks = run_ranks("resume_with_a_late_rank", 2, tmp_path / "late", expect_failure=True, timeout=120,
                      env=gpudl_joins(), resume=f"{tmp_path}/runs/cut", late_rank=1, seconds=90,
                      sets=[*segment_sets(tmp_path, 2, 4, "parallel.dp_replicate"), "parallel.timeout_s=5"])
    elapsed = time.monotonic() - t0
    code, out = ranks[0]
    assert code != 0
    assert "the load plan exchange / read (DCP) in the checkpoint load timed out after 5 s on rank 0" in out, out
    assert "rank 1 never arrived (last in the checkpoint load" in out
    assert "damaged" not in out and "incompatible" not in out
    assert elapsed < 5 + 30 + 15  # the timeout, the 30 s the error may take, process start-up


def test_a_rank_that_never_joins_is_named_within_the_timeout(tmp_path):
    """The rendezvous is held to parallel.timeout_s too, and says which rank is missing (torch's says how many)."""
    t0 = time.monotonic()
    ranks = run_ranks("join_late", 2, tmp_path, expect_failure=True, timeout=120, env=gpudl_joins(),
                      sets=["parallel.dp_replicate=2", "parallel.timeout_s=5", f"run.dir={tmp_path}/runs",
                            "run.name=late"], late_rank=1, seconds=90)
    elapsed = time.monotonic() - t0
    code, out = ranks[0]
    assert code != 0
    assert "the rendezvous (check-in on the job's store) timed out after 5 s on rank 0: rank 1 never arrived" in out
    assert elapsed < 5 + 30  # the timeout, process start-up, the helper's 5 s for the other ranks
