"""Each data-parallel strategy, on real processes, against one process training on the full batch."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from bodies import TINY
from gpudl.config import load_config
from gpudl.training.recipe import train
from helper import backends, run_ranks


def reference(tmp_path, global_batch: int) -> dict:
    """One process, the whole batch: what every parallel layout must reproduce."""
    cfg = load_config(None, [*TINY, f"train.batch_size={global_batch}", f"run.dir={tmp_path}", "run.name=ref"])
    result = train(cfg, console=Console(quiet=True))
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "params": {k: v.detach().cpu() for k, v in result.model.state_dict().items()}}


def assert_same_training(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert got["losses"].keys() == want["losses"].keys()
    for step, loss in want["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=tol), f"loss at step {step}"
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        assert torch.allclose(got["params"][name], p, atol=tol, rtol=0), name


@pytest.fixture(scope="module")
def ref8(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("ref8"), 8)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("layout", [["parallel.dp_replicate=2"], ["parallel.dp_shard=2"],
                                    ["parallel.dp_shard=2", "parallel.fsdp_cpu_offload=true"]],
                         ids=["ddp", "fsdp", "fsdp-cpu-offload"])
def test_data_parallel_equals_one_process_on_the_full_batch(tmp_path, ref8, backend, layout):
    ranks = run_ranks("train_tiny", 2, tmp_path, backend,
                      sets=[*layout, f"run.dir={tmp_path}/runs", "run.name=dp"])
    assert ranks[0]["losses"] == ranks[1]["losses"]  # every rank logs the job's (reduced) loss
    assert_same_training(ranks[0], ref8)
    assert ranks[0]["summary"]["samples_per_s"] > 0


@pytest.mark.parametrize("backend", backends())
def test_hsdp_equals_one_process_on_the_full_batch(tmp_path, tmp_path_factory, backend):
    want = reference(tmp_path_factory.mktemp("ref16"), 16)
    ranks = run_ranks("train_tiny", 4, tmp_path, backend, timeout=300,
                      sets=["parallel.dp_replicate=2", "parallel.dp_shard=2", f"run.dir={tmp_path}/runs",
                            "run.name=hsdp"])
    assert_same_training(ranks[0], want)
