"""Turn a collective that times out, or whose peer is gone, into an error that names the collective
and the rank (and its host).

A collective that waits for a stalled rank fails after the process group's timeout with a
message such as "Timed out waiting 60000ms for recv operation": no operation, no rank. So
every rank notes in the job's key-value store where it is (step and phase) as it goes; when a
collective times out, the rank that saw it reads everyone's notes and names the rank that is
behind. One small store write per step. A rank whose process died takes its connections with it
("Connection reset by peer" from the backend, at once): the address in that message and each
rank's host, noted at start-up, name the rank and the machine that went away.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from ..errors import UserError

# What the processes exchange in each phase, by layout, for the error message.
_STEP_COLLECTIVES = {"dp_replicate": "gradient all-reduce (DDP)",
                     "dp_shard": "parameter all-gather / gradient reduce-scatter (FSDP)",
                     "tp": "activation all-reduce (tensor parallel)", "pp": "activation send/recv (pipeline)"}
_PHASE_COLLECTIVES = {"logging": "loss all-reduce", "evaluation": "evaluation all-reduce",
                      "checkpoint save": "checkpoint barrier / gather", "checkpoint load": "checkpoint load (DCP)",
                      "plan agreement": "broadcast of rank 0's decisions (plan, layout, run folder)",
                      "model set-up": "mesh set-up / parameter broadcast (DDP, FSDP)"}
# Phases before the first step: a timeout there is "in the <phase>", not "of step N".
STARTUP_PHASES = ("start-up", "plan agreement", "model set-up", "checkpoint load")
_TIMEOUT_WORDS = ("timed out", "timeout", "watchdog")
# What Gloo and NCCL say when the process at the other end of a connection is gone.
_LOST_WORDS = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exited")
_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")
# How long a rank that timed out waits for the others' timeouts before naming the ones missing: ranks
# waiting on one stalled rank time out within a few seconds of each other, and never more apart than
# the timeout itself, so a short timeout (a test's, a small job's) gets a short grace.
TIMEOUT_GRACE_S = 10.0
# What a store's answer may take beyond that, before the store is taken to be out of reach.
STORE_SLACK_S = 5.0


class CollectiveTimeout(UserError):
    """A collective waited longer than parallel.timeout_s for another rank."""


class PeerLost(UserError):
    """A collective's connection to another rank broke: its process, or its host, is gone."""


def is_timeout(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(w in str(error).lower() for w in _TIMEOUT_WORDS)


def is_peer_lost(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(w in str(error).lower() for w in _LOST_WORDS)


def _my_host() -> list[str]:
    """This rank's hostname and the address the others reach it at (the route to the job's store)."""
    from .addresses import address_towards
    master = os.environ.get("MASTER_ADDR")
    address = address_towards(master, int(os.environ.get("MASTER_PORT", "0") or 0)) if master else None
    return [socket.gethostname(), address or ""]


class StepWatch:
    """This rank's notes in the store, and a diagnosis of a timeout from everyone's notes."""

    def __init__(self, rank: int, world: int, layout: dict[str, int], timeout_s: int):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.set_layout(layout)
        # The store that rendezvous created; torch has no public accessor for it.
        self.store = dist.distributed_c10d._get_default_store() if world > 1 and dist.is_initialized() else None
        self.step, self.phase, self.collective = 0, "start-up", None
        if self.store is not None:
            self.store.set(f"gpudl/host/{rank}", json.dumps(_my_host()))

    def set_layout(self, layout: dict[str, int]) -> None:
        """The parallel degrees, once they are known (the start-up's collectives come before them)."""
        self.layout = {k: v for k, v in layout.items() if v > 1}

    def note(self, step: int, phase: str, collective: str | None = None) -> None:
        """Where this rank is; `collective` names the one it is about to enter, where the phase has several kinds."""
        self.step, self.phase, self.collective = step, phase, collective
        if self.store is not None:
            self.store.set(f"gpudl/progress/{self.rank}", json.dumps([step, phase, time.time()]))

    @contextmanager
    def during(self, phase: str, collective: str | None = None):
        """Note `phase` (and `collective`); a collective in it that times out becomes the named error."""
        self.note(self.step, phase, collective)
        try:
            yield
        except RuntimeError as e:  # torch's DistBackendError is one
            if is_timeout(e):
                raise self.diagnose(e) from e
            if is_peer_lost(e):
                raise self.lost(e) from e
            raise

    def _read(self, prefix: str) -> dict[int, list]:
        out = {}
        for r in range(self.world):
            key = f"{prefix}/{r}"
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def collectives(self, phase: str) -> str:
        if self.collective:
            return self.collective
        if phase == "training step":
            return " / ".join(_STEP_COLLECTIVES[k] for k in ("pp", "tp", "dp_shard", "dp_replicate") if k in self.layout)
        return _PHASE_COLLECTIVES.get(phase, "collective")

    def _late_ranks(self) -> tuple[list[int], dict[int, list]]:
        """Ranks that did not time out too: every rank waiting on a stalled one times out within the
        same few seconds, so the ranks that never report a timeout are the ones holding the job up."""
        self.store.set(f"gpudl/timeout/{self.rank}", json.dumps([self.step, self.phase, time.time()]))
        deadline = time.time() + self._grace_s()
        while time.time() < deadline and len(self._read("gpudl/timeout")) < self.world:
            time.sleep(0.5)
        waited = self._read("gpudl/timeout")
        return sorted(set(range(self.world)) - set(waited)), self._read("gpudl/progress")

    def _grace_s(self) -> float:
        return min(TIMEOUT_GRACE_S, self.timeout_s)

    def _briefly(self, read, empty):
        """`read()` from the store, given the grace and a few seconds more: a store on a host gone or out of
        reach blocks a call for as long as TCP keeps trying (a timeout set on the store does not bound a
        call already waiting for its answer), so the call runs in a thread that is left behind."""
        if self.store is None:
            return empty
        done: list = []
        worker = threading.Thread(target=lambda: done.append(read()), daemon=True, name="gpudl-store-read")
        worker.start()
        worker.join(self._grace_s() + STORE_SLACK_S)
        if not done:
            raise TimeoutError("the job's store did not answer")
        return done[0]

    def diagnose(self, error: BaseException) -> CollectiveTimeout:
        when = f"in the {self.phase}" if self.phase in STARTUP_PHASES else f"of step {self.step}"
        where = f"the {self.collectives(self.phase)} {when} timed out after {self.timeout_s} s on rank {self.rank}"
        store_silent = False
        try:
            late, notes = self._briefly(self._late_ranks, ([], {}))
        except Exception:  # the store lives with rank 0's host, which may be gone or cut off from this one
            late, notes, store_silent = [], {}, True
        now = time.time()
        if store_silent:
            who = (f"the job's store (on rank 0's host) did not answer within {self._grace_s() + STORE_SLACK_S:.0f} s either: this "
                   f"host is cut off from the others' network, or rank 0's host is down")
        elif late:
            who = "; ".join(f"rank {r} never arrived" + (f" (last {_at(*notes[r][:2])}, "
                                                       f"{now - notes[r][2]:.0f} s ago)" if r in notes else "")
                            for r in late)
        else:
            who = "no rank could be singled out (a rank died or the network failed)"
        return CollectiveTimeout(f"{where}: {who}. Look at that rank's output; if such a wait is expected, "
                                 f"raise --set parallel.timeout_s (now {self.timeout_s})")

    def lost(self, error: BaseException) -> PeerLost:
        """The rank (and host) whose connection broke, from the address in the backend's message."""
        when = f"in the {self.phase}" if self.phase in STARTUP_PHASES else f"of step {self.step}"
        found = _PEER_ADDRESS.search(str(error))
        address = found.group(1) if found else None
        try:
            hosts = self._briefly(lambda: self._read("gpudl/host"), {})
        except Exception:  # the store lives with rank 0, which may be the rank that is gone
            hosts = {}
        ranks = [r for r, (_, addr) in hosts.items() if address and addr == address and r != self.rank]
        if ranks:
            who = " and ".join(f"rank {r}" for r in ranks) + f" on {hosts[ranks[0]][0]} ({address})"
        else:
            who = f"the rank at {address}" if address else "another rank"
        return PeerLost(f"{who} is gone: its connection broke during the {self.collectives(self.phase)} {when} "
                        f"(seen by rank {self.rank}). Its process or its host stopped; the newest complete "
                        f"checkpoint is intact, and the run resumes from it with the same command and --resume")


def _at(step: int, phase: str) -> str:
    return f"in the {phase}" if phase in STARTUP_PHASES else f"at step {step}, {phase}"
