"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (preemption: SLURM, Kubernetes, torchrun's agent).

The first signal only raises a flag: the step in progress finishes, every rank agrees on the
step to stop after, a checkpoint is written and the run says how to resume it. A second Ctrl-C
gets the default action (the process ends at once): its handler is gone by then. A repeated
SIGTERM is ignored: schedulers send it more than once to one stop (SLURM to every process of a
job step, then torchrun's agent to its workers, milliseconds apart), and follow it with SIGKILL
when they stop waiting; taken as "stop at once", it would lose the checkpoint the stop is for.

Ranks agree without a blocking collective per step: after each step every rank starts an
asynchronous MAX all-reduce of its flag (on a Gloo group of its own, so that on GPUs no device
work is waited for), and reads the previous step's result. Every rank reads the same sequence of
results, so they stop after the same step, one step after the first rank saw the signal.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Catches SIGINT and SIGTERM while installed; `agreed()` says, the same on every rank, when to stop."""

    def __init__(self, group: dist.ProcessGroup | None = None, announce: bool = True):
        self.group, self.announce = group, announce
        self.seen: int | None = None      # the signal this process received
        self.signum: int | None = None    # the signal every rank agreed to stop for
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for s, handler in self._previous.items():
            if signal.getsignal(s) == self._on_signal:  # not after a first signal: a second must still kill
                signal.signal(s, handler)
        if self._pending is not None and exc_type is None:
            self._pending[0].wait()  # every rank started it: let none be left in flight on the group

    def _on_signal(self, signum: int, frame) -> None:
        if self.seen is not None:  # a repeated SIGTERM (SIGINT's handler is gone after the first signal)
            return
        self.seen = signum
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if self.announce:  # os.write: a signal handler must not re-enter buffered or rich console output
            os.write(2, f"\n{signal.Signals(signum).name}: finishing this step, then a checkpoint and stop "
                        f"(Ctrl-C to stop at once, without one)\n".encode())

    def agreed(self) -> bool:
        """True once all ranks know of a signal (one process: as soon as it came)."""
        if self.group is None:
            self.signum = self.seen
            return self.seen is not None
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self.signum = int(flag.item()) or None
        flag = torch.tensor([self.seen or 0], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""
