"""The public API: `gpudl.train` and `gpudl.fit` as a script calls them, again and again."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from rich.console import Console

import gpudl
from gpudl.cli import main

QUIET = Console(quiet=True)


def test_no_public_name_is_also_a_submodule():
    """A submodule imported anywhere would replace the package attribute of the same name (it did:
    `gpudl/train.py` shadowed `gpudl.train` once `gpudl.run` was imported)."""
    for name in gpudl.__all__:
        assert importlib.util.find_spec(f"gpudl.{name}") is None, name


def test_train_runs_twice_and_after_fit(tiny):
    first = gpudl.train(tiny("run.name=a"), console=QUIET)
    second = gpudl.train(tiny("run.name=b"), console=QUIET)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    fitted = gpudl.fit(torch.nn.Linear(4, 2), (x, y), loss=F.cross_entropy, max_steps=2, batch_size=16,
                       device="cpu", progress=False, quiet=True)
    third = gpudl.train(tiny("run.name=c"), console=QUIET)
    assert fitted.metrics.steps == 2
    losses = [[r["loss"] for r in run.records if r["kind"] == "train"] for run in (first, second, third)]
    assert losses[0] and losses[0] == losses[1] == losses[2]  # same seed, same config: the same run each time


def test_a_model_the_tensor_plan_cannot_split_is_refused_once_before_any_worker(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--device", "cpu", "--nproc-per-node", "2", "--set", "parallel.tp=2",
                 "--set", "model.n_head=3", "--set", "model.d_model=96"])
    out = capsys.readouterr()
    assert code == 2 and "Launching" not in out.out
    assert len(out.err.strip().splitlines()) == 1 and "n_head=3" in out.err and "tp=2" in out.err, out.err
    assert not (tmp_path / "runs").exists()
