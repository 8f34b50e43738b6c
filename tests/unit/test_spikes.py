"""Loss spikes: flagged on the host and on the device by the same rule; warned, skipped or fatal in a real run.

The reference for a skipped spike is the non-finite guard, an independent and separately tested
mechanism: a run whose step 30 has a NaN loss skips that update too, so its weights after the run
must be bit for bit those of the run that skips step 30 as a spike.
"""

import json
import math
import shutil

import pytest
import torch
from rich.console import Console

from gpudl import models
from gpudl.checkpoint import complete_checkpoints
from gpudl.errors import UserError
from gpudl.training.loop import TrainState
from gpudl.run.recipe import train
from gpudl.training.spikes import MIN_HISTORY, LossSpike, SpikeHistory, SpikeVeto

QUIET = Console(quiet=True)
SPIKE_STEP = 30
RUN = ["train.max_steps=40", "train.log_every=8", "train.eval_every=0", "optim.warmup_steps=5",
       "sample.tokens=0", "checkpoint.export=false", "log.plot=false"]


def _losses(n, spikes, seed=0):
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(n, generator=g) * 0.4 + 0.8).tolist()  # +-20% around a falling curve: never 5x
    return [(3.0 - step / n) * x * (40.0 if step in spikes else 1.0) for step, x in enumerate(noise, 1)]


def test_the_device_veto_flags_exactly_the_steps_the_host_history_flags():
    spikes = {4, 27, 28, 41, 77}  # one in the warm-up, two in a row, the rest alone
    losses = _losses(90, spikes)
    losses[50] = math.nan  # a non-finite loss is no spike and does not enter the history
    host = SpikeHistory(factor=5.0, window=30, warmup_steps=8)
    veto = SpikeVeto(factor=5.0, window=30, warmup_steps=8, reduce=lambda t: t)
    state = TrainState()
    host_found, device_flags = [], []
    for step, loss in enumerate(losses, 1):
        if (record := host.check(step, step - 1, loss)) is not None:
            host_found.append((step, record["median"]))
        device_flags.append(veto(torch.tensor(loss), state).item())
        state.step = step
    device_found = [(s, m) for s, (flag, m) in enumerate(torch.stack(veto.flags).tolist(), 1) if flag]
    assert [s for s, _ in host_found] == [27, 28, 41, 77]  # step 4: before the warm-up's end and MIN_HISTORY
    assert [s for s, _ in device_found] == [s for s, _ in host_found]
    assert [m for _, m in device_found] == pytest.approx([m for _, m in host_found], rel=1e-6)
    assert [s for s, f in enumerate(device_flags, 1) if f] == [27, 28, 41, 77]
    veto.settle(state)
    assert state.loss_history == pytest.approx(host.history, rel=1e-6) and len(host.history) == 30


def test_no_spike_is_called_before_the_history_holds_enough_losses():
    host = SpikeHistory(factor=5.0, window=100, warmup_steps=0)
    found = [host.check(step, step, 100.0 if step == MIN_HISTORY else 1.0) for step in range(1, MIN_HISTORY + 1)]
    assert found == [None] * MIN_HISTORY  # the 20th loss meets a history of 19
    assert host.check(MIN_HISTORY + 1, 0, 100.0) is not None


def _inject(monkeypatch, factor, at=SPIKE_STEP, first=1):
    """The recipe's loss, times `factor` at training step `at` (`first`: the step this process starts at)."""
    real = models.loss_for
    calls = {"n": first - 1}

    def patched(spec):
        loss = real(spec)

        def fn(model, batch):
            calls["n"] += batch[0].device.type != "meta"  # FLOP counting runs once on the meta device
            return loss(model, batch) * factor if calls["n"] == at else loss(model, batch)
        return fn
    monkeypatch.setattr(models, "loss_for", patched)


def _records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_a_warned_spike_is_recorded_with_its_step_and_batch(tiny, monkeypatch):
    _inject(monkeypatch, 50.0)
    run = train(tiny(*RUN, "run.name=warn"), console=QUIET)
    (spike,) = _records(run.run_dir, "spike")
    assert (spike["step"], spike["batch"]) == (SPIKE_STEP, SPIKE_STEP - 1)  # one batch a step, counted from 0
    assert spike["ratio"] > 5 and spike["loss"] == pytest.approx(spike["ratio"] * spike["median"], rel=1e-3)
    assert run.summary["loss_spikes"] == 1


def test_a_skipped_spike_leaves_the_weights_of_a_skipped_non_finite_step_also_after_a_resume(tiny, monkeypatch):
    """The spike's update is skipped: the weights are bit for bit those of a run whose step 30 had a NaN
    loss. Resumed from step 20's checkpoint, the spike is still skipped: the median it is measured
    against is the one the checkpoint kept (a history of 9 steps would be too short to call it one)."""
    on = [*RUN, "train.on_spike=skip", "checkpoint.every=20", "train.log_every=1"]
    _inject(monkeypatch, 50.0)
    skipped = train(tiny(*on, "run.name=skip"), console=QUIET)
    _inject(monkeypatch, math.nan)
    nan = train(tiny(*on, "run.name=nan"), console=QUIET)
    assert skipped.summary["loss_spikes"] == 1 and skipped.summary["nonfinite_steps"] == 0
    assert nan.summary["nonfinite_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(skipped.model.parameters(), nan.model.parameters()))

    last = complete_checkpoints(skipped.run_dir / "checkpoints")[-1]
    assert json.loads((last.parent / "step_00000020" / "state.json").read_text())["train_state"]["loss_history"]
    shutil.rmtree(last)  # as if the run had died after step 20's checkpoint
    _inject(monkeypatch, 50.0, first=21)
    resumed = train(tiny(*on, "run.name=skip"), resume=skipped.run_dir, console=QUIET)
    assert resumed.summary["loss_spikes"] == 1
    assert all(torch.equal(a, b) for a, b in zip(skipped.model.parameters(), resumed.model.parameters()))


def test_on_spike_stop_ends_the_run_naming_the_step_the_batch_and_the_checkpoint_before_it(tiny, monkeypatch):
    _inject(monkeypatch, 50.0)
    with pytest.raises(LossSpike, match=r"loss spike at step 30 \(batch 29\).*step_00000024, predates it"):
        train(tiny(*RUN, "run.name=stop", "train.on_spike=stop", "checkpoint.every=12"), console=QUIET)


def test_a_spike_factor_of_one_or_less_is_refused(tiny):
    with pytest.raises(UserError, match=r"train.spike_factor=0.5 would call most steps a loss spike"):
        train(tiny("train.spike_factor=0.5"), console=QUIET)
