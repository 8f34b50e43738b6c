"""One rank's NaN, or one rank's loss spike under train.on_spike=skip, skips the step on every rank, exactly
as one process skips it."""

from __future__ import annotations

import torch
from rich.console import Console

from bodies import on, poison_loss
from gpudl import models
from gpudl.config import load_config
from gpudl.run.recipe import train
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


def test_one_ranks_loss_spike_is_skipped_on_every_rank_as_one_process_skips_a_nan(tmp_path, monkeypatch, device):
    """Rank 1's loss x200 at step 25: the mean over the ranks is a spike, so both skip that update (a rank
    that did not would train other weights). The reference is one process on the whole batch whose
    step 25 is skipped by the non-finite guard."""
    need_devices(device, 2)
    spike = ["train.max_steps=26", "train.on_spike=skip", "train.eval_every=0"]
    monkeypatch.setattr(models, "loss_for", models.loss_for)
    poison_loss(None, 25)
    ref = train(load_config(None, on(device, [*spike, "train.batch_size=8", f"run.dir={tmp_path}", "run.name=ref"])),
                console=Console(quiet=True))
    assert ref.summary["nonfinite_steps"] == 1
    # DDP: had rank 0 not skipped too, its weights would not be the reference's (FSDP reduces the loss alike)
    ranks = run_ranks("train_poisoned", 2, tmp_path, device, rank=1, step=25, factor=200.0,
                      sets=["parallel.dp_replicate=2", *spike, f"run.dir={tmp_path}", "run.name=spike"])
    assert [r["summary"]["loss_spikes"] for r in ranks] == [1, 1]
    assert [r["summary"]["nonfinite_steps"] for r in ranks] == [0, 0]
    for name, p in ref.model.state_dict().items():
        assert torch.allclose(ranks[0]["params"][name], p.detach().cpu(), atol=tolerance(device), rtol=0), name
