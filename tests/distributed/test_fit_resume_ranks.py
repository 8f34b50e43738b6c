"""gpudl.fit's checkpoints on one and two processes: a run cut after a checkpoint and resumed trains,
evaluates and ends as the run that was never cut, bit for bit on the CPU; its validation loss is
the final model's, computed here by a plain loop."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from bodies import hf_gpt2_and_data, user_model_and_data
from helper import run_ranks
from gpudl.checkpoint import complete_checkpoints


def plain_val_loss(model: str, params: dict) -> float:
    """The validation loss of a model with `params`, by a plain loop over the 128 held-out samples."""
    if model == "user":
        net, (x, y) = user_model_and_data()
        net.load_state_dict(params)
        with torch.no_grad():
            return F.cross_entropy(net(x[384:]), y[384:]).item()
    net, columns = hf_gpt2_and_data()
    net.load_state_dict(params, strict=False)  # the tied head is stored once
    net.eval()
    ids = columns["input_ids"][192:]
    with torch.no_grad():  # batches of 16, each the mean over its sequences, weighed alike (equal sizes)
        return sum(net(input_ids=b, labels=b).loss.item() for b in ids.split(16)) / len(ids.split(16))


@pytest.mark.parametrize("world, model, data, parallel", [
    (1, "user", "tensors", {}),
    (2, "user", "dataloader", {}),
    (2, "hf", "columns", {"dp_shard": 2}),
], ids=["1-user-tensors", "2-user-dataloader-ddp", "2-hf-gpt2-columns-fsdp"])
def test_a_resumed_fit_ends_as_the_run_that_was_never_cut(tmp_path, world, model, data, parallel):
    run = tmp_path / "run"
    kw = dict(model=model, data=data, parallel=parallel, run_dir=str(run))
    whole = run_ranks("fit_resumable", world, tmp_path / "whole", **kw)[0]
    ckpts = complete_checkpoints(run / "checkpoints")
    assert [c.name for c in ckpts] == ["step_00000006", "step_00000009"]
    shutil.rmtree(ckpts[-1])  # as if the run had died after step 6's checkpoint
    resumed = run_ranks("fit_resumable", world, tmp_path / "resumed", resume=True, **kw)[0]
    assert resumed["losses"] == {s: v for s, v in whole["losses"].items() if s > 6}
    assert resumed["evals"] == [e for e in whole["evals"] if e["step"] > 6] and resumed["steps"] == 9
    assert resumed["params"].keys() == whole["params"].keys()
    for name, p in whole["params"].items():
        assert torch.equal(resumed["params"][name], p), name
    assert [e["step"] for e in whole["evals"]] == [4, 8, 9]
    assert whole["evals"][-1]["loss"] == pytest.approx(plain_val_loss(model, whole["params"]), abs=1e-6)
