"""Faults: a stalled rank becomes a named error; checkpoints reshard between world sizes."""

from __future__ import annotations

import time

import pytest
import torch

from helper import run_ranks


def test_a_stalled_rank_is_named_within_the_timeout(tmp_path):
    t0 = time.monotonic()
    ranks = run_ranks("train_with_stall", 2, tmp_path, expect_failure=True, timeout=120,
                      env={"GPUDL_TEST_TIMEOUT_S": "10"},
                      sets=["parallel.dp_replicate=2", "parallel.timeout_s=10", f"run.dir={tmp_path}/runs",
                            "run.name=stall"], stall_rank=1, stall_step=3, seconds=90)
    elapsed = time.monotonic() - t0
    code, out = ranks[0]
    assert code != 0
    assert "gradient all-reduce (DDP) of step 3 timed out after 10 s on rank 0" in out
    assert "rank 1 never arrived" in out
    assert elapsed < 10 + 30 + 15  # the timeout, the 30 s the error may take, process start-up


def same_state(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[k][field]), torch.as_tensor(sb[k][field])), (k, field)


@pytest.mark.slow
def test_checkpoints_reshard_from_4_to_2_to_1_ranks(tmp_path):
    common = [f"run.dir={tmp_path}/runs", "run.name=reshard", "checkpoint.every=4", "checkpoint.export=false"]
    run = f"{tmp_path}/runs/reshard"
    four = run_ranks("train_and_state", 4, tmp_path / "w4", timeout=300,
                     sets=[*common, "parallel.dp_shard=4", "train.max_steps=4"])[0]
    two = run_ranks("train_and_state", 2, tmp_path / "w2", sets=[*common, "parallel.dp_shard=2",
                                                                   "train.max_steps=4"], resume=run)[0]
    same_state(four, two)  # restored on 2 ranks: the very tensors 4 ranks saved
    two_on = run_ranks("train_and_state", 2, tmp_path / "w2b", sets=[*common, "parallel.dp_shard=2",
                                                                       "train.max_steps=6"], resume=run)[0]
    from bodies import TINY
    from gpudl.config import load_config
    from gpudl.training.recipe import train
    from rich.console import Console
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    one = train(load_config(None, [*TINY, *common, "train.max_steps=6"]), resume=run, console=Console(quiet=True))
    same_state(two_on, {"params": {k: v.detach() for k, v in one.model.state_dict().items()},
                        "optim": get_optimizer_state_dict(one.model, one.optimizer)})
