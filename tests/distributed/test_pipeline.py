"""Pipeline parallelism: the stage split (one process) and each schedule on real processes."""

from __future__ import annotations

import shutil

import pytest
from rich.console import Console

from bodies import TINY, on
from gpudl.config import load_config
from gpudl.run.recipe import train
from helper import need_devices, run_ranks, tolerance
from test_strategies import assert_same_training

# Four layers: interleaved-1f1b with pp=2 runs 2 stages per rank, each needs a layer.
PP_MODEL = ["model.n_layer=4", "model.tie_embeddings=false"]


def losses_of(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def reference(tmp_path, *sets: str, device: str = "cpu") -> dict:
    """One process, the whole batch, the same untied four-layer model, on the same kind of device."""
    cfg = load_config(None, on(device, [*PP_MODEL, *sets, f"run.dir={tmp_path}", "run.name=ref"]))
    result = train(cfg, console=Console(quiet=True))
    return {"losses": losses_of(result.records),
            "evals": [r for r in result.records if r["kind"] == "eval"],
            "params": {k: v.detach().cpu() for k, v in result.model.state_dict().items()}}


_untied: dict[tuple, dict] = {}


def untied_reference(tmp_path_factory, device: str, *sets: str) -> dict:
    """`reference` of the untied model, run once per session for each device and settings."""
    if (device, sets) not in _untied:
        _untied[device, sets] = reference(tmp_path_factory.mktemp("ref"), *sets, device=device)
    return _untied[device, sets]


@pytest.fixture
def ref_untied(tmp_path_factory) -> dict:
    return untied_reference(tmp_path_factory, "cpu")


@pytest.mark.parametrize("schedule", [["parallel.pp_schedule=gpipe"], ["parallel.pp_schedule=1f1b"],
                                      ["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_stages_per_rank=2"]],
                         ids=["gpipe", "1f1b", "interleaved-1f1b"])
def test_pipeline_equals_one_process_on_the_full_batch(tmp_path, tmp_path_factory, device, schedule):
    need_devices(device, 2)
    want = untied_reference(tmp_path_factory, device)
    ranks = run_ranks("train_gathered", 2, tmp_path, device,
                      sets=[*PP_MODEL, "parallel.pp=2", *schedule, f"run.dir={tmp_path}/runs", "run.name=pp"])
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the last stage's loss, on every rank
    assert_same_training(ranks[0], want, tolerance(device))
    n = sum(p.numel() for p in want["params"].values())
    assert ranks[0]["summary"]["params_m"] == pytest.approx(n / 1e6)  # the whole model's, not the stage's
    for got, evaluated in zip(ranks[0]["evals"], want["evals"]):
        assert got["loss"] == pytest.approx(evaluated["loss"], abs=tolerance(device))


def test_pipeline_accumulates_gradients_over_micro_steps(tmp_path):
    """Two schedule steps per optimizer step: gradients add up, scaled once."""
    want = reference(tmp_path / "ref", "train.grad_accum=2")
    ranks = run_ranks("train_gathered", 2, tmp_path, sets=[*PP_MODEL, "parallel.pp=2", "train.grad_accum=2",
                                                           f"run.dir={tmp_path}/runs", "run.name=pp"])
    assert_same_training(ranks[0], want)


@pytest.mark.parametrize("layout", [
    ["parallel.dp_shard=2", "parallel.pp_schedule=1f1b"],
    ["parallel.dp_replicate=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_stages_per_rank=2"],
], ids=["fsdp-1f1b", "replicate-interleaved"])
def test_pipeline_with_data_parallelism_equals_one_process_on_the_full_batch(tmp_path, tmp_path_factory, layout):
    want = untied_reference(tmp_path_factory, "cpu", "train.batch_size=8")  # one run for both layouts
    ranks = run_ranks("train_gathered", 4, tmp_path, timeout=300,
                      sets=[*PP_MODEL, "parallel.pp=2", *layout, f"run.dir={tmp_path}/runs", "run.name=pp"])
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert_same_training(ranks[0], want)


def test_pipeline_with_tensor_parallelism_equals_one_process(tmp_path, ref_untied):
    """Each stage's blocks sharded over tp=2 (sequence parallel), two stages per pipeline rank."""
    ranks = run_ranks("train_gathered", 4, tmp_path, timeout=300,
                      sets=[*PP_MODEL, "parallel.pp=2", "parallel.tp=2", "parallel.tp_sequence_parallel=true",
                            "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_stages_per_rank=2",
                            f"run.dir={tmp_path}/runs", "run.name=pp"])
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert_same_training(ranks[0], ref_untied)


def test_pipeline_checkpoints_resume_in_the_pipeline_and_in_one_process(tmp_path, ref_untied):
    """Saved by two stages, loaded by two stages or by the whole model: the names are the whole
    model's (optimizer state included), and DCP reshards."""
    sets = [*PP_MODEL, "parallel.pp=2", "checkpoint.every=5", f"run.dir={tmp_path}/runs", "run.name=pp"]
    run_ranks("train_gathered", 2, tmp_path / "first", sets=sets)
    *_, newest = sorted((tmp_path / "runs" / "pp" / "checkpoints").glob("step_*"))
    shutil.rmtree(newest)  # resume from step 5
    shutil.copytree(tmp_path / "runs" / "pp", tmp_path / "runs" / "whole")  # each resume writes its own
    again = run_ranks("train_gathered", 2, tmp_path / "again", sets=sets, resume=str(tmp_path / "runs" / "pp"))[0]
    cfg = load_config(None, [*TINY, *PP_MODEL, f"run.dir={tmp_path}/runs"])
    whole = train(cfg, resume=tmp_path / "runs" / "whole", console=Console(quiet=True))
    for name, records in (("pp=2", again["losses"]), ("one process", losses_of(whole.records))):
        assert sorted(records) == list(range(6, 11)), name
        for step, loss in records.items():
            assert loss == pytest.approx(ref_untied["losses"][step], abs=1e-5), f"{name}, loss at step {step}"
