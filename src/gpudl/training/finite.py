"""Steps whose gradients are not finite: the update is skipped, the step counted, and the run stopped
after `train.max_nonfinite` such steps in a row.

Two guards do this, one chosen per job before the loop starts (`finite_guard`):

- `HostGuard` reads the gradient norm on the host every step and decides there. On the CPU that
  read costs nothing, and it is the only way for an optimizer without a fused kernel.
- `DeviceGuard` decides on the device. A host read would stop the host from queueing the next
  step's kernels until the GPU had caught up, every step. Instead the fused optimizer gets a
  `found_inf` flag, the way torch's GradScaler drives fused optimizers: its kernel leaves weights,
  moments and step counts as they were where the flag is set. The counts stay on the device too,
  and are read with the losses once per log interval (`settle`), so a run of non-finite steps
  stops the job at the next interval rather than at the step itself; the skipped updates never
  touched the weights, so nothing is lost by the wait.

>>> import torch
>>> from gpudl.training.loop import TrainState
>>> guard, state = HostGuard(), TrainState()
>>> guard.count(False, state), guard.count(False, state), guard.count(True, state)
(False, False, True)
>>> state.nonfinite_total, state.nonfinite_in_a_row, guard.settle(state)
(2, 0, 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import UserError
from .precision import Precision


class NonFiniteError(UserError):
    """Too many steps in a row had a NaN or Inf gradient."""


class TrainState(Protocol):
    """What a guard reads and keeps of the loop's state (`loop.TrainState`)."""

    step: int
    nonfinite_in_a_row: int
    nonfinite_total: int


class FiniteGuard(Protocol):
    on_host: bool   # True: decides every step on the host, so the loop checks the counts every step

    def update(self, precision: Precision, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
               state: TrainState, veto: torch.Tensor | None = None) -> bool:
        """The optimizer step unless the gradients are not finite or `veto` (a 0-dim 0/1 flag: a loss
        spike, `spikes.py`) is set; True when `optimizer.step()` ran. A vetoed step is not counted
        as non-finite."""

    def settle(self, state: TrainState) -> int:
        """Bring the counts into `state`; the longest run of non-finite steps so far."""


def stop_if_too_many(longest: int, state: TrainState, limit: int) -> None:
    if longest >= limit:
        raise NonFiniteError(f"{limit} steps in a row had NaN/Inf gradients (seen by step {state.step}): "
                             f"lower optim.lr, use precision=bf16-mixed or fp32, or check the data")


@dataclass
class HostGuard:
    """Decides on the host: reads the gradient norm every step."""

    on_host = True
    _longest: int = 0

    def update(self, precision: Precision, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
               state: TrainState, veto: torch.Tensor | None = None) -> bool:
        finite = self.count(math.isfinite(grad_norm.item()), state)  # one read; no isfinite kernel to launch first
        wanted = finite and not (veto is not None and bool(veto))
        precision.step(optimizer, wanted)  # a skipped step leaves weights and moments untouched
        return wanted

    def count(self, finite: bool, state: TrainState) -> bool:
        state.nonfinite_in_a_row = 0 if finite else state.nonfinite_in_a_row + 1
        state.nonfinite_total += not finite
        self._longest = max(self._longest, state.nonfinite_in_a_row)
        return finite

    def count_flags(self, flags: list[float], state: TrainState) -> None:
        """Count steps decided elsewhere (a flag of 1.0: not finite), in order, carrying on a resumed run's streak."""
        self._longest = max(self._longest, state.nonfinite_in_a_row)
        for flag in flags:
            self.count(not flag, state)

    def settle(self, state: TrainState) -> int:
        return self._longest


class DeviceGuard:
    """Decides on the device: the fused optimizer skips the update itself; no host read per step.

    A step adds three small kernels of its own (the flag from the norm) besides the optimizer's
    handling of the flag; the flags are kept as they are and counted on the host when `settle`
    reads them, once per log interval, in one transfer."""

    on_host = False

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []   # each step's flag since the last settle, float32 on the device
        self._host = HostGuard()                # counts the flags once they are on the host

    def update(self, precision: Precision, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
               state: TrainState, veto: torch.Tensor | None = None) -> bool:
        # 1.0 where the norm is NaN or Inf (x * 0 is NaN exactly then): fewer kernels than isfinite's composite
        found_inf = torch.isnan(grad_norm * 0).to(torch.float32)
        precision.step_unless(optimizer, found_inf if veto is None else torch.maximum(found_inf, veto), veto)
        self._flags.append(found_inf)
        return True

    def settle(self, state: TrainState) -> int:
        if self._flags:
            self._host.count_flags(torch.stack(self._flags).tolist(), state)  # one device -> host transfer
            self._flags.clear()
        return max(self._host.settle(state), state.nonfinite_in_a_row)


def finite_guard(device: torch.device, optimizer: torch.optim.Optimizer) -> FiniteGuard:
    """The device guard where it can skip on the device (an accelerator and a fused optimizer), else the host's.
    Where the weights are decides, not where the job runs: FSDP's CPU offload keeps them, their
    gradients and the update on the host, whose guard reads a norm already there."""
    fused = bool(optimizer.defaults.get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False)
    weights_on = next((p.device for group in optimizer.param_groups for p in group["params"]), device)
    return DeviceGuard() if weights_on.type != "cpu" and fused else HostGuard()
