"""The run's side of the training loop: metrics every `log_every` steps, evaluation lines, checkpoints.

Per-step losses stay on the device and are read in one transfer per log interval; time spent
evaluating and checkpointing is left out of the throughput figures.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from ..checkpoint import Checkpointer
from ..checkpoint.background import BackgroundWriter
from ..config import TrainConfig
from ..data import DeviceLoader
from ..distributed.watch import StepWatch
from ..errors import UserError
from ..observe.metrics import Throughput, peak_memory_bytes
from ..observe.sinks import ConsoleProgress
from .budget import StepBudget
from .interrupt import StopRequest
from ..training.loop import Job, TrainState
from ..training.micro import OutOfMemory
from ..distributed.session import Session
from ..training.spikes import LossSpike, SpikeLog

SPIKES_SHOWN = 10  # loss spikes said on the console; all are recorded
SPIKE_ACTION = {"warn": "its update was applied", "skip": "its update was skipped", "stop": "the run stops"}


@dataclass
class Saver:
    """Checkpoints of a job: every `every` steps (0: only at the last) and whenever the run stops early."""

    checkpointer: Checkpointer
    job: Job
    every: int = 0
    background: BackgroundWriter | None = None  # checkpoint.async: saves are written on a thread of their own

    def due(self, step: int, last: int) -> bool:
        return step == last or (self.every > 0 and step % self.every == 0)

    def save(self, state: TrainState) -> None:
        job = self.job
        job.guard.settle(state)  # the non-finite counts a device guard keeps on the device
        extra = {"train_state": dataclasses.asdict(state), "scheduler": job.scheduler.state_dict(),
                 "scaler": job.precision.state_dict()}
        (self.background or self.checkpointer).save(state.step, job.model, job.optimizer, extra)

    def check(self) -> None:
        """A background write that failed since the last step is raised now (one process; see background.py)."""
        if self.background is not None:
            self.background.poll()


@dataclass
class Monitor:
    """Implements the loop's `Events`: records, sinks, progress, periodic checkpoints, stop requests."""

    session: Session              # the device (memory figures) and the mean over data-parallel ranks
    train: TrainConfig            # log_every, max_steps
    throughput: Throughput
    sinks: list = field(default_factory=list)
    progress: ConsoleProgress | None = None
    loader: DeviceLoader | None = None   # how long the loop waited for data
    saver: Saver | None = None
    watch: StepWatch | None = None        # where this rank is, for stall reports (several processes)
    stop: StopRequest | None = None      # SIGINT/SIGTERM: save and stop early
    budget: StepBudget | None = None     # train.time_budget_s: decides max_steps after the first steps
    spikes: SpikeLog | None = None       # loss spikes: records, the count, train.on_spike
    records: list[dict] = field(default_factory=list)
    _losses: list = field(default_factory=list)
    _norms: list = field(default_factory=list)
    _wait_mark: float = 0.0
    _excluded: float = 0.0
    _step_end: float = 0.0
    _lr: float = 0.0
    _saved_step: int = -1

    def note(self, step: int, phase: str) -> None:
        if self.watch is not None:
            self.watch.note(step, phase)

    def on_step(self, state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        self.throughput.tick()
        self._losses.append(loss)
        self._norms.append(grad_norm)
        self._lr = lr
        if self.spikes is not None:
            self.spikes.step(state)
        if self.budget is not None and self.budget.on_step(state):
            self.budget = None  # decided: train.max_steps is the run's length now
        if state.step % self.train.log_every == 0 or state.step == self.train.max_steps:
            self._log(state, lr)
        self._step_end = time.perf_counter()

    def _log(self, state: TrainState, lr: float) -> None:
        self.note(state.step, "logging")
        losses = self.session.reduce_mean(torch.stack(self._losses)).tolist()  # one device->host transfer
        norms = torch.stack(self._norms).float().tolist()
        self._losses.clear()
        self._norms.clear()
        self._review_spikes(state, losses)
        rates = self.throughput.window(exclude_s=self._excluded)
        self._excluded = 0.0
        wait = self.loader.wait_s if self.loader is not None else 0.0
        window_s = rates["step_s"] * len(losses)
        finite_losses = [x for x in losses if math.isfinite(x)]
        record = {  # a window of non-finite losses only has no loss: NaN, never 0
            "kind": "train", "step": state.step,
            "loss": sum(finite_losses) / len(finite_losses) if finite_losses else float("nan"),
            "lr": lr, "grad_norm": norms[-1], **rates,
            "peak_mem_gb": peak_memory_bytes(self.session.device.torch_device) / 2**30,
            "data_wait_frac": min(1.0, (wait - self._wait_mark) / window_s) if window_s > 0 else 0.0,
            "nonfinite_total": state.nonfinite_total,
        }
        self._wait_mark = wait
        self._report_bad_images(state, record)
        self._emit(record)
        if self.progress is not None:
            self.progress.update(record)

    def _report_bad_images(self, state: TrainState, record: dict) -> None:
        """Files the loader could not decode (this rank's): a running count, the first few named once."""
        bad = getattr(self.loader, "bad_images", None)
        if bad is None:
            return
        record["bad_images_total"] = bad.count
        if self.progress is not None:
            for line in bad.news():
                self.progress.print(f"step {state.step:>6} · skipped an image file (a substitute took its place): "
                                    f"{line}")

    def on_eval(self, state: TrainState, metrics: dict[str, float]) -> None:
        self._excluded += time.perf_counter() - self._step_end  # evaluation ran since the step ended
        self.note(state.step, "evaluation")
        means = self.session.reduce_mean(torch.tensor(list(metrics.values()))).tolist()  # each rank: its own share
        record = {"kind": "eval", "step": state.step, **dict(zip(metrics, means))}
        self._emit(record)
        if self.progress is not None:
            shown = " · ".join(f"{k} {v:.4f}" for k, v in record.items() if k not in ("kind", "step"))
            self.progress.print(f"step {state.step:>6} · validation {shown}")

    def on_oom(self, state: TrainState, oom: OutOfMemory) -> None:
        """A step that ran out of memory and is being run again with a smaller micro-batch: said and recorded."""
        self._emit(oom.record())
        if self.progress is not None:
            self.progress.print(f"step {oom.step:>6} · out of memory ({oom.error}): micro-batch {oom.micro_batch} "
                                f"-> {oom.halved_to}, the step runs again")

    def after_step(self, state: TrainState) -> None:
        if self.saver is not None:
            self.saver.check()
        if self.saver is not None and self.saver.due(state.step, self.train.max_steps):
            t0 = time.perf_counter()
            self._save(state)
            self._excluded += time.perf_counter() - t0
        self.note(state.step + 1, "training step")

    def should_stop(self, state: TrainState) -> bool:
        """After a stop request every rank agreed on: log the open window, save this step, stop."""
        if self.stop is None or not self.stop.agreed():
            return False
        if self._losses:
            self._log(state, self._lr)
        if self.saver is not None and self._saved_step != state.step:
            self._save(state)
        return True

    def _save(self, state: TrainState) -> None:
        if self.spikes is not None:  # a spike since the last log is known before its weights are kept
            if self.spikes.pending:
                pending = self._losses[-self.spikes.pending:]
                self._review_spikes(state, self.session.reduce_mean(torch.stack(pending)).tolist())
            self.spikes.settle(state)
        self.note(state.step, "checkpoint save")
        self.saver.save(state)
        self._saved_step = state.step

    def _review_spikes(self, state: TrainState, losses: list[float]) -> None:
        """Record and say each loss spike among the steps not yet reviewed (`losses`: their last ones)."""
        if self.spikes is None or not self.spikes.pending:
            return
        for record in self.spikes.review(state, losses[-self.spikes.pending:]):
            self._emit(record)
            if self.progress is not None and state.spikes <= SPIKES_SHOWN:
                more = " (further spikes are recorded in metrics.jsonl only)" if state.spikes == SPIKES_SHOWN else ""
                self.progress.print(f"step {record['step']:>6} · loss spike: {record['loss']:.4g} is "
                                    f"{record['ratio']:.1f}x the recent median {record['median']:.4g} (batch "
                                    f"{record['batch']}); {SPIKE_ACTION[self.train.on_spike]}{more}")
            if self.train.on_spike == "stop":
                raise self._spike_stop(record)

    def _spike_stop(self, record: dict) -> LossSpike:
        latest = self._newest_checkpoint()
        back = f"the newest checkpoint, {latest}, predates it" if latest else "no checkpoint predates it"
        return LossSpike(f"loss spike at step {record['step']} (batch {record['batch']}): loss {record['loss']:.4g} "
                         f"is {record['ratio']:.1f}x the median {record['median']:.4g} of the recent steps, and "
                         f"train.on_spike=stop; {back}: resume from it with --set train.on_spike=skip to skip such "
                         f"steps, or check that batch")

    def _newest_checkpoint(self):
        """The newest complete checkpoint, once a background write in flight (of a step before now) has landed."""
        if self.saver is None:
            return None
        if self.saver.background is not None:
            try:
                self.saver.background.wait()
            except UserError:
                pass  # the run is ending for another reason; a write that failed leaves the one before it newest
        return self.saver.checkpointer.latest()

    def _emit(self, record: dict) -> None:
        self.records.append(record)
        for sink in self.sinks:
            sink.write(record)
