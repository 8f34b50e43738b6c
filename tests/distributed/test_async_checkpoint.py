"""checkpoint.async on two ranks: FSDP's shards staged as local shards, written on the writer's own
Gloo group, renamed once both ranks wrote; one process restores exactly what the two held."""

from __future__ import annotations

from bodies import resume_on_this_world
from helper import run_ranks
from test_resume import same_state


def test_background_saves_of_fsdp_shards_restore_bit_for_bit(tmp_path):
    from gpudl.checkpoint import complete_checkpoints

    common = [f"run.dir={tmp_path}/runs", "run.name=bg", "checkpoint.every=2", "checkpoint.export=false",
              "train.max_steps=4", "checkpoint.async=true"]
    two = run_ranks("resume_on_this_world", 2, tmp_path / "w2", sets=[*common, "parallel.dp_shard=2"])[0]
    assert "Checkpoint saves: in the background (checkpoint.async=true" in two["printed"]
    run = tmp_path / "runs" / "bg"
    assert [c.name for c in complete_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000004"]
    assert not list((run / "checkpoints").glob("*.tmp"))
    one = resume_on_this_world(common, resume=str(run))  # restores step 4 and trains no further
    same_state(two, one["restored"])
