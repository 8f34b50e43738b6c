"""checkpoint.async on two ranks: FSDP's shards staged as local shards, written on the writer's own
Gloo group, renamed once both ranks wrote; one process restores exactly what the two held."""

from __future__ import annotations

from helper import run_ranks
from test_faults import same_state


def test_background_saves_of_fsdp_shards_restore_bit_for_bit(tmp_path):
    from bodies import TINY
    from rich.console import Console
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from gpudl.checkpoint import complete_checkpoints
    from gpudl.config import load_config
    from gpudl.training.recipe import train

    common = [f"run.dir={tmp_path}/runs", "run.name=bg", "checkpoint.every=2", "checkpoint.export=false",
              "train.max_steps=4"]
    two = run_ranks("train_and_state", 2, tmp_path / "w2",
                    sets=[*common, "parallel.dp_shard=2", "checkpoint.async=true"])[0]
    run = tmp_path / "runs" / "bg"
    assert [c.name for c in complete_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000004"]
    assert not list((run / "checkpoints").glob("*.tmp"))
    one = train(load_config(None, [*TINY, *common]), resume=run, console=Console(quiet=True))  # restores, trains none
    same_state(two, {"params": {k: v.detach() for k, v in one.model.state_dict().items()},
                     "optim": get_optimizer_state_dict(one.model, one.optimizer)})
