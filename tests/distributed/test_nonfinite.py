"""One rank's NaN skips the step on every rank, exactly as one process skips it."""

from __future__ import annotations

import torch
from rich.console import Console

from bodies import on, poison_loss
from gpudl import models
from gpudl.config import load_config
from gpudl.training.recipe import train
from helper import need_devices, run_ranks, tolerance


def test_one_ranks_nan_skips_the_step_everywhere(tmp_path, monkeypatch, device):
    need_devices(device, 2)
    monkeypatch.setattr(models, "loss_for", models.loss_for)  # poison_loss patches it; undo after the test
    poison_loss(None, 3)
    ref = train(load_config(None, on(device, ["train.batch_size=8", f"run.dir={tmp_path}", "run.name=ref"])),
                console=Console(quiet=True))
    assert ref.summary["nonfinite_steps"] == 1
    for layout in (["parallel.dp_replicate=2"], ["parallel.dp_shard=2"]):
        ranks = run_ranks("train_poisoned", 2, tmp_path / layout[0], device, rank=1, step=3,
                          sets=[*layout, f"run.dir={tmp_path}/{layout[0]}", "run.name=nan"])
        assert [r["summary"]["nonfinite_steps"] for r in ranks] == [1, 1], layout
        for name, p in ref.model.state_dict().items():
            assert torch.allclose(ranks[0]["params"][name], p.detach().cpu(), atol=tolerance(device), rtol=0), \
                (layout, name)
