"""A run sized by time (`train.time_budget_s`): the first steps are timed, and the run's length
becomes the number of steps that fit in the budget.

This is how the default recipe's first run takes about the same time on any CPU: a laptop with
bf16 instructions trains more steps than one without, each to the end of its schedule. The
decision is made once, the same on every rank (rank 0's measurement), within the warm-up of
the default recipe (so no step taken so far had another learning rate than it would have had),
and written into the run's config.toml as a plain `max_steps`: a resumed run is the run that
was decided. Evaluation and checkpoints are not in the measurement: the budget is "about".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import Config
from ..device import synchronize
from ..observe.sinks import ConsoleProgress
from ..training.loop import Job, TrainState
from ..training.optim import set_total_steps
from ..distributed.session import Session

# Steps timed before deciding, after this process's first step (allocation, kernel choices: not timed).
TIMED_STEPS = 19


@dataclass
class StepBudget:
    """Decides `cfg.train.max_steps` from the time of the first TIMED_STEPS steps after this process's first."""

    cfg: Config
    session: Session
    job: Job
    progress: ConsoleProgress | None = None
    on_decided: Callable[[Config], None] = lambda cfg: None   # e.g. write the run's config.toml
    _first: int | None = None
    _t0: float = 0.0

    @staticmethod
    def wanted(cfg: Config, state: TrainState) -> bool:
        return cfg.train.time_budget_s > 0 and state.step + 1 + TIMED_STEPS < cfg.train.max_steps

    def on_step(self, state: TrainState) -> bool:
        """After each step: start the clock after the first, decide once enough were timed (True: decided).

        The two clock readings wait for the device: an accelerator runs behind the host, which queues
        steps ahead. Once per run, not per step."""
        if self._first is None or state.step - self._first >= TIMED_STEPS:
            synchronize(self.session.device.torch_device)
        now = time.perf_counter()
        if self._first is None:
            self._first, self._t0 = state.step, now
            return False
        if state.step - self._first < TIMED_STEPS:
            return False
        self._decide(state.step, (now - self._t0) / (state.step - self._first))
        return True

    def _decide(self, step: int, step_s: float) -> None:
        train = self.cfg.train
        budget, wanted = train.time_budget_s, train.max_steps
        steps = self.session.agree(max(step, min(wanted, int(budget / step_s))))
        train.max_steps, train.time_budget_s = steps, 0.0  # decided: the run is now this many steps
        set_total_steps(self.job.scheduler, self.cfg.optim, steps)
        self.on_decided(self.cfg)
        if self.progress is not None:
            self.progress.set_total(steps)
            self.progress.print(f"Time budget {budget:g} s: a step takes {step_s * 1e3:.0f} ms, so {steps} of "
                                f"{wanted} steps" + (" (--set train.time_budget_s=0 trains them all)"
                                                     if steps < wanted else ""))
