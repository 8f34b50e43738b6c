"""Pipeline parallelism: the stage split (one process) and each schedule on real processes."""

from __future__ import annotations

import shutil

import pytest
import torch
from rich.console import Console

from bodies import TINY
from gpudl.config import load_config
from gpudl.run import train
from helper import backends, run_ranks
from test_strategies import assert_same_training

# Four layers: interleaved-1f1b with pp=2 runs 2 stages per rank, each needs a layer.
PP_MODEL = ["model.n_layer=4", "model.tie_embeddings=false"]


@pytest.fixture(scope="module")
def ref_untied(tmp_path_factory) -> dict:
    """One process, the whole batch, the same untied four-layer model."""
    tmp_path = tmp_path_factory.mktemp("ref")
    cfg = load_config(None, [*TINY, *PP_MODEL, f"run.dir={tmp_path}", "run.name=ref"])
    result = train(cfg, console=Console(quiet=True))
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "evals": [r for r in result.records if r["kind"] == "eval"],
            "params": {k: v.detach().cpu() for k, v in result.model.state_dict().items()}}


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("schedule", [["parallel.pp_schedule=gpipe"], ["parallel.pp_schedule=1f1b"],
                                      ["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_stages_per_rank=2"]],
                         ids=["gpipe", "1f1b", "interleaved-1f1b"])
def test_pipeline_equals_one_process_on_the_full_batch(tmp_path, ref_untied, backend, schedule):
    ranks = run_ranks("train_gathered", 2, tmp_path, backend,
                      sets=[*PP_MODEL, "parallel.pp=2", *schedule, f"run.dir={tmp_path}/runs", "run.name=pp"])
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the last stage's loss, on every rank
    assert_same_training(ranks[0], ref_untied)
    for got, want in zip(ranks[0]["evals"], ref_untied["evals"]):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)


def test_pipeline_checkpoint_resumes_in_one_process(tmp_path, ref_untied):
    """Saved by two stages, loaded whole: the names are the whole model's, and DCP reshards."""
    run_ranks("train_gathered", 2, tmp_path, sets=[*PP_MODEL, "parallel.pp=2", "checkpoint.every=5",
                                                   f"run.dir={tmp_path}/runs", "run.name=pp"])
    *older, newest = sorted((tmp_path / "runs" / "pp" / "checkpoints").glob("step_*"))
    shutil.rmtree(newest)  # resume from step 5
    cfg = load_config(None, [*TINY, *PP_MODEL, f"run.dir={tmp_path}/runs"])
    resumed = train(cfg, resume=tmp_path / "runs" / "pp", console=Console(quiet=True))
    losses = {r["step"]: r["loss"] for r in resumed.records if r["kind"] == "train"}
    assert sorted(losses) == list(range(6, 11))
    for step, loss in losses.items():
        assert loss == pytest.approx(ref_untied["losses"][step], abs=1e-5), f"loss at step {step}"
