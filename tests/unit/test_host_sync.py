"""No host sync per training step on accelerators: the host reads device values once per log interval.

A host read of a device value (`.item()`, `bool(t)`, `.tolist()`, ...) makes the host wait for the
device, so it cannot queue the next step's kernels meanwhile. On the CPU there is nothing to wait
for, so the test counts the calls that would sync (a function mode sees each one) and notes the
step during which each happened. On an accelerator, torch's own sync detector counts them too.
The default recipe runs through `gpudl.train` with the guard an accelerator gets.
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode

import gpudl.training.job as job_module
import gpudl.run.runner as runner
from gpudl.training.finite import DeviceGuard, HostGuard

# Tensor methods that copy a device value to the host (and so wait for the device).
HOST_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero}


# Where batches are made on the host before the device loader copies them: reads there wait for
# nothing on an accelerator, so they are not counted.
HOST_SIDE = f"{os.sep}gpudl{os.sep}data{os.sep}"


class HostReads(TorchFunctionMode):
    """Records `state.step` at every host read of a tensor value outside the host-side data code."""

    def __init__(self, state):
        super().__init__()
        self.state, self.steps = state, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and not _in_host_side_code(sys._getframe(1)):
            self.steps.append(self.state.step)
        return func(*args, **(kwargs or {}))


def _in_host_side_code(frame) -> bool:
    while frame is not None:
        name = frame.f_code.co_filename
        if HOST_SIDE in name and not name.endswith("loader.py"):  # the device loader itself counts
            return True
        frame = frame.f_back
    return False


@contextmanager
def accelerator_syncs(device: str, steps: list, state):
    """torch's sync detector on CUDA: each synchronizing call warns; the warning notes the step."""
    if not device.startswith("cuda"):
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda *args, **kw: steps.append(state.step)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _run(tiny, monkeypatch, guard=None, device="cpu") -> list[int]:
    """Train 12 steps logging every 4; the step during which each host read (or sync) happened.
    `guard`: the non-finite guard to use (None: the one gpudl chooses for the device)."""
    reads, real_loop = [], runner.train_loop

    def counted_loop(job, cfg, state, events):
        with HostReads(state) as mode, accelerator_syncs(device, reads, state):
            try:
                return real_loop(job, cfg, state, events)
            finally:
                reads.extend(mode.steps)
    monkeypatch.setattr(runner, "train_loop", counted_loop)
    if guard is not None:
        monkeypatch.setattr(job_module, "finite_guard", lambda device, optimizer: guard())
    from gpudl.run.recipe import train
    from rich.console import Console
    cfg = tiny("train.max_steps=12", "train.log_every=4", "train.eval_every=12", "checkpoint.every=0",
               "sample.tokens=0", f"run.device={device}")
    train(cfg, console=Console(quiet=True))
    return reads


def test_the_device_guard_reads_the_host_only_at_log_steps(tiny, monkeypatch):
    reads = _run(tiny, monkeypatch, DeviceGuard)
    assert reads and {step % 4 for step in reads} == {0}, reads  # steps 1-3, 5-7, 9-11 read nothing


def test_the_host_guard_reads_every_step(tiny, monkeypatch):
    """What the count above would show if a per-step read crept back: the CPU's own guard does one."""
    reads = _run(tiny, monkeypatch, HostGuard)
    assert set(range(12)) <= set(reads), reads


@pytest.mark.accelerator
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's sync detector needs CUDA")
def test_no_sync_between_log_steps_on_cuda(tiny, monkeypatch):
    reads = _run(tiny, monkeypatch, device="cuda")
    assert reads and {step % 4 for step in reads} == {0}, reads
