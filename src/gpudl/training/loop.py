"""The training loop: forward, backward and the optimizer step, batch by batch.

Everything that differs between devices, precisions and parallel strategies was decided
before the loop starts and arrives here as objects (`Job`): the loop has no branches on them.
One step = the step's data (drawn once) in micro-batches of forward + backward, then unscale,
clip, the update unless the gradients are not finite (decided on the device where it can be,
`finite.py`), and the schedule. A step that runs out of memory is run again from its start with
half the micro-batch (`micro.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
import warnings
from typing import Protocol

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import UserError
from ..distributed.parts import clip_grad_norm
from ..data.loader import Batch
from .finite import FiniteGuard, HostGuard, stop_if_too_many
from .finite import NonFiniteError  # noqa: F401  (where callers import it from)
from .micro import OutOfMemory, is_out_of_memory, micro_batches, release, rows
from .precision import Precision


@dataclass
class TrainState:
    """What the loop has done so far; saved with every checkpoint."""

    step: int = 0                 # optimizer steps taken (skipped ones included)
    batches: int = 0              # micro-batches consumed: the data position
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    micro_batch: int = 0          # rows per forward once out-of-memory recovery halved it (0: the job's)
    loss_history: list[float] = field(default_factory=list)  # the losses loss spikes are measured against
    spikes: int = 0               # loss spikes seen (`spikes.py`)


def standard_micro_step(job: Job, batch: Batch, scale: float) -> torch.Tensor:
    """Forward under the precision's autocast, backward of the loss times `scale`; the detached loss."""
    with job.precision.autocast():
        loss = job.loss_fn(job.model, batch)
    job.precision.backward(loss * scale if scale != 1.0 else loss)
    return loss.detach()


@dataclass
class Job:
    """Everything the loop needs, already placed on the device and wrapped for the strategy."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    batches: Iterator[Batch]
    eval_fn: Callable[[nn.Module, Batch], dict[str, torch.Tensor]] | None = None
    eval_batches: Callable[[], Iterable[Batch]] | None = None
    # Context for micro-batch backward: DDP/FSDP skip their gradient sync unless it is the last one.
    grad_sync: Callable[[bool], AbstractContextManager] = field(default=lambda last: nullcontext())
    # Forward + backward of one micro-batch (a pipeline brings its own schedule-driven one).
    micro_step: Callable[[Job, Batch, float], torch.Tensor] = standard_micro_step
    # Global gradient norm over this rank's parameters, clipping to max_norm when > 0.
    clip_norm: Callable[[list[torch.Tensor], float], torch.Tensor] = clip_grad_norm
    draws: int = 1                # batches drawn from `batches` per step: the step's data
    micro_batch: int = 0          # rows per forward (0: each drawn batch whole)
    # True on every rank when it is true on any: ranks redo an out-of-memory step together.
    any_rank: Callable[[bool], bool] = field(default=lambda flag: flag)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Skips the update of a step whose gradients are not finite, and counts such steps.
    guard: FiniteGuard = field(default_factory=HostGuard)
    # train.on_spike = "skip": (loss, state) -> a 0-dim flag, 1 where the step's update is skipped (`spikes.py`);
    # None where no step is vetoed.
    spike_veto: Callable[[torch.Tensor, TrainState], torch.Tensor | None] = field(default=lambda loss, state: None)
    # False: gradients are zeroed between steps, not freed (CUDA graphs need buffers that outlive a replay).
    grads_to_none: bool = True


class Events(Protocol):
    """What the run does around the loop: metrics, evaluation logs, checkpoints."""

    def on_step(self, state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None: ...
    def on_eval(self, state: TrainState, metrics: dict[str, float]) -> None: ...
    def on_oom(self, state: TrainState, oom: OutOfMemory) -> None: ...
    def after_step(self, state: TrainState) -> None: ...
    def should_stop(self, state: TrainState) -> bool: ...


class NoEvents:
    """The loop's events, ignored: for callers that time or measure steps from outside the loop."""

    def on_step(self, *args) -> None: ...
    def on_eval(self, *args) -> None: ...
    def on_oom(self, *args) -> None: ...
    def after_step(self, *args) -> None: ...

    def should_stop(self, *args) -> bool:
        return False


class OutOfMemoryAtOneRow(UserError):
    """A micro-batch of one sample does not fit: no halving can help."""


def forward_backward(job: Job, micros: list[Batch]) -> torch.Tensor:
    """Accumulate gradients over `micros`, each weighed by its share of the rows; their weighted mean loss."""
    sizes = [rows(b) for b in micros]
    all_rows, total = sum(sizes), None
    for i, (batch, n) in enumerate(zip(micros, sizes)):
        weight = n / all_rows
        with job.grad_sync(i == len(micros) - 1):
            loss = job.micro_step(job, batch, weight)
        weighted = loss * weight if weight != 1.0 else loss
        total = weighted if total is None else total + weighted
    return total


def fitting_forward_backward(job: Job, data: list[Batch], state: TrainState, events: Events) -> torch.Tensor:
    """`forward_backward` of the step's data; when the ranks run out of memory, each drops the attempt's
    gradients, halves the micro-batch and runs the step again from its start.

    Ranks with the same shapes run out at the same point and meet in one collective before the redo.
    No collective is spent on steps that fit: a rank that did not run out is by then waiting inside a
    collective of the step (gradient all-reduce, all-gather) that the others never reach, so a check
    after the step could not reach it either; such a job ends at the collective timeout."""
    while True:
        micro = min(state.micro_batch or job.micro_batch or 2**62, max(rows(b) for b in data))
        try:
            return forward_backward(job, micro_batches(data, micro))
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(e):
                raise
            error = (str(e).splitlines() or [type(e).__name__])[0]  # the message only: the frames must go
        job.any_rank(True)  # every rank that ran out meets here before any redoes the step
        job.optimizer.zero_grad(set_to_none=job.grads_to_none)  # nothing of the failed attempt survives
        release(job.device)
        if micro <= 1:
            raise OutOfMemoryAtOneRow(f"out of memory at step {state.step + 1} with a micro-batch of one sample "
                                      f"({error})")
        state.micro_batch = micro // 2
        events.on_oom(state, OutOfMemory(state.step + 1, micro, micro // 2, error))


def clip_gradients(job: Job, max_norm: float) -> torch.Tensor:
    """Unscale (fp16), then clip to `max_norm` (0: measure only); returns the global grad norm."""
    job.precision.unscale(job.optimizer)
    params = [p for g in job.optimizer.param_groups for p in g["params"]]
    return job.clip_norm(params, max_norm)


@torch.no_grad()
def evaluate(job: Job) -> dict[str, float]:
    """Mean of each evaluation metric over the evaluation samples, in eval mode."""
    job.model.eval()
    sums: dict[str, torch.Tensor] = {}
    n = 0
    for batch in job.eval_batches():
        n_rows = rows(batch)  # a finite evaluation set's last batch may be smaller: weigh by rows (dicts too)
        with job.precision.autocast():
            for key, value in job.eval_fn(job.model, batch).items():
                sums[key] = sums.get(key, 0) + value.detach().float() * n_rows
        n += n_rows
    job.model.train()
    return {k: float(v) / max(n, 1) for k, v in sums.items()}


def advance_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer_stepped: bool) -> None:
    """One step of the schedule, also for a skipped step, so that it stays in step with `state.step`
    (torch warns when the very first step is skipped; that order is intended here)."""
    if optimizer_stepped:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def train_loop(job: Job, cfg: TrainConfig, state: TrainState, events: Events) -> TrainState:
    """Train from `state` to `cfg.max_steps`, reporting to `events`, or until they ask to stop."""
    job.model.train()
    while state.step < cfg.max_steps:
        data = [next(job.batches) for _ in range(job.draws)]  # kept until the step is done: a redo needs it
        state.batches += job.draws
        loss = fitting_forward_backward(job, data, state, events)
        grad_norm = clip_gradients(job, cfg.grad_clip)
        veto = job.spike_veto(loss, state)
        stepped = job.guard.update(job.precision, job.optimizer, grad_norm, state, veto)
        job.optimizer.zero_grad(set_to_none=job.grads_to_none)
        lr = job.scheduler.get_last_lr()[0]
        advance_schedule(job.scheduler, stepped)
        state.step += 1
        if job.guard.on_host or _due(state.step, cfg.log_every, cfg.max_steps):  # the device's: with the losses
            stop_if_too_many(job.guard.settle(state), state, cfg.max_nonfinite)
        events.on_step(state, loss, grad_norm, lr)
        if job.eval_batches is not None and _due(state.step, cfg.eval_every, cfg.max_steps):
            events.on_eval(state, evaluate(job))
        events.after_step(state)
        if events.should_stop(state):
            break
    job.guard.settle(state)
    return state
