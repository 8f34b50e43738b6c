"""Loss spikes: a step whose loss is far above the recent median is flagged, and skipped or fatal if asked.

A spike is a step whose loss (the mean over data-parallel ranks, so every rank agrees) exceeds
`train.spike_factor` times the median of the last `train.spike_window` accepted losses, once the
learning-rate warm-up is over and at least `MIN_HISTORY` losses are known (and only while that
median is positive: a ratio says nothing about losses that can be zero or negative). Spikes and non-finite
losses do not enter the history, so a run of bad steps is still measured against the good ones.
The record names the step and its first batch: with data a pure function of (seed, batch) that
identifies exactly what the step saw.

Two detectors share that one rule (`is_spike`):

- `SpikeHistory`, on the host, reads the losses the monitor already brings over once per log
  interval: `train.on_spike = "warn"` (the default) and `"stop"` cost nothing per step.
- `SpikeVeto`, on the device, decides before the update for `"skip"`: the optimizer step of a
  spiking step is skipped the way a non-finite step is (`finite.py`), with no host read per step.
  It costs one small all-reduce and a handful of tiny kernels per step, so it runs only when asked.

>>> h = SpikeHistory(factor=5.0, window=100, warmup_steps=0)
>>> [h.check(step, step, loss) for step, loss in enumerate([2.0] * 20, 1)][-1] is None
True
>>> h.check(21, 21, 11.0)["ratio"]
5.5
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import UserError

# Losses a median needs before a step can be called a spike: fewer would make noise look like one.
MIN_HISTORY = 20


def lower_median(values: list[float]) -> float:
    """The lower of the two middle values for an even count: what `torch.nanmedian` returns, so that
    the host's and the device's detectors agree on every step."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def checked_history(saved, window: int) -> list[float]:
    """A checkpoint's loss history (state.json, written elsewhere maybe): finite numbers only, the newest `window`."""
    if not isinstance(saved, list):
        return []
    return [float(x) for x in saved if isinstance(x, (int, float)) and math.isfinite(x)][-window:]


class SpikeHistory:
    """The host's detector: fed each step's loss in order, returns a spike record or None."""

    def __init__(self, factor: float, window: int, warmup_steps: int, history: list[float] | None = None):
        self.factor, self.window, self.warmup_steps = factor, window, warmup_steps
        self.history = checked_history(history or [], window)

    def check(self, step: int, batch: int, loss: float) -> dict | None:
        if not math.isfinite(loss):
            return None
        if step > self.warmup_steps and len(self.history) >= MIN_HISTORY:
            median = lower_median(self.history)
            if median > 0 and loss > self.factor * median:  # a ratio means nothing for losses at or below 0
                return spike_record(step, batch, loss, median)
        self.history = [*self.history[-(self.window - 1):], loss]
        return None


def spike_record(step: int, batch: int, loss: float, median: float) -> dict:
    return {"kind": "spike", "step": step, "batch": batch, "loss": loss, "median": median,
            "ratio": round(loss / median, 3) if median > 0 else float("inf")}


class SpikeVeto:
    """The device's detector: a 0/1 flag per step, made before the update; nothing read on the host.

    `reduce` gives the mean of a loss over the data-parallel ranks (identity in one process), so
    that every rank skips the same steps.
    """

    def __init__(self, factor: float, window: int, warmup_steps: int, reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.factor, self.window, self.warmup_steps, self.reduce = factor, window, warmup_steps, reduce
        self._ring: torch.Tensor | None = None   # (window,) the accepted losses, oldest first; NaN where none yet
        self.flags: list[torch.Tensor] = []      # (flag, median) per step since the monitor last read them

    def _start(self, history: list[float], device: torch.device) -> torch.Tensor:
        """The ring, from the history a resumed run brings in its state."""
        ring = torch.full((self.window,), float("nan"), dtype=torch.float32)
        saved = checked_history(history, self.window)
        if saved:
            ring[-len(saved):] = torch.tensor(saved, dtype=torch.float32)
        return ring.to(device)

    def __call__(self, loss: torch.Tensor, state) -> torch.Tensor:
        """1.0 where the step now ending (`state.step + 1`) is a spike and its update must be skipped, else 0.0."""
        step = state.step + 1
        loss = self.reduce(loss.detach().float().reshape(()))
        if self._ring is None:
            self._ring = self._start(state.loss_history, loss.device)
        if step > self.warmup_steps:  # a host fact: no device value decides this branch
            known = (~torch.isnan(self._ring)).sum()
            median = torch.nanmedian(self._ring)
            spike = (known >= MIN_HISTORY) & (median > 0) & (loss > self.factor * median)
        else:
            spike = torch.zeros((), dtype=torch.bool, device=loss.device)
            median = torch.full((), math.nan, device=loss.device)
        accept = torch.isfinite(loss) & ~spike
        shifted = torch.cat([self._ring[1:], loss.reshape(1)])
        self._ring = torch.where(accept, shifted, self._ring)
        flag = spike.to(torch.float32)
        self.flags.append(torch.stack([flag, median]))
        return flag

    def settle(self, state) -> None:
        """The accepted losses into `state.loss_history`, oldest first (one device -> host transfer)."""
        if self._ring is not None:
            state.loss_history = [x for x in self._ring.tolist() if not math.isnan(x)]


def check_spike_settings(train) -> None:
    if 0 < train.spike_factor <= 1:
        raise UserError(f"train.spike_factor={train.spike_factor} would call most steps a loss spike: set a factor "
                        f"above 1 (the default is 5), or 0 to turn spike detection off")


def veto_for(train, warmup_steps: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> SpikeVeto | None:
    """The device veto when `train.on_spike == "skip"` (and detection is on), else None."""
    check_spike_settings(train)
    if train.on_spike != "skip" or not train.spike_factor:
        return None
    return SpikeVeto(train.spike_factor, train.spike_window, warmup_steps, reduce)


class LossSpike(UserError):
    """train.on_spike = "stop": a loss spike ends the run."""


class SpikeLog:
    """The run's side of spike detection: which step and batch each loss belongs to, the records, the count.

    The monitor calls `step` after every step, then `review` with the losses of the steps since the
    last review (host floats, in order) at each log interval and before each checkpoint.
    """

    def __init__(self, train, warmup_steps: int, veto: SpikeVeto | None, state):
        self.on_spike, self.veto = train.on_spike, veto
        self.history = SpikeHistory(train.spike_factor, train.spike_window, warmup_steps, state.loss_history) \
            if train.spike_factor and veto is None else None
        self._batch = state.batches              # the first batch of the next step
        self._steps: list[tuple[int, int]] = []  # (step, its first batch) not yet reviewed

    def step(self, state) -> None:
        self._steps.append((state.step, self._batch))
        self._batch = state.batches

    @property
    def pending(self) -> int:
        return len(self._steps)

    def review(self, state, losses: list[float]) -> list[dict]:
        """Spike records of the pending steps; `losses` are theirs (means over the data-parallel ranks)."""
        steps, self._steps = self._steps, []
        if self.veto is not None:  # the device decided: read its flags and medians (one transfer)
            marks = torch.stack(self.veto.flags).tolist() if self.veto.flags else []
            self.veto.flags.clear()
            found = [spike_record(step, batch, loss, median)
                     for (step, batch), loss, (flag, median) in zip(steps, losses, marks) if flag]
        elif self.history is not None:
            found = [r for (step, batch), loss in zip(steps, losses) if (r := self.history.check(step, batch, loss))]
            state.loss_history = list(self.history.history)
        else:
            found = []
        state.spikes += len(found)
        return found

    def settle(self, state) -> None:
        """The device's history into `state`, for a checkpoint."""
        if self.veto is not None:
            self.veto.settle(state)
