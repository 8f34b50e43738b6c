"""Estimates on a job of several processes, traced in worker processes whose default group is torch's
fake process group (collectives return at once), so that gpudl's real sharding and tensor-parallel
code runs as rank 0 with nobody else there, and the caller's own process group is left alone.

A planner asks for many estimates, from a thread per layout, and an estimate of a deep GPT is two
traces (`depth.py`), asked for side by side: each trace goes to a free worker; workers are
started on first need, up to one per CPU, and kept until the jobs are closed. A job of one
process needs no fake group: it is estimated in the caller's process, one trace at a time (unless it
asks for FSDP's CPU offload: FSDP over a group of one, the worker's fake one).

Protocol: one JSON request per line on the worker's stdin ({"config": TOML text}), one answer per
line on its stdout: {"phases": {piece: {category: bytes}}} (a trace at the config's depth) or,
for a pipeline, {"parts": {category: bytes}} (its rank with the largest peak); or
{"error": "...", "user": bool} (`user`: a UserError, said as it is).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import tomllib
from concurrent.futures import ThreadPoolExecutor

from ..config import Config
from ..device.discovery import usable_cpus
from ..errors import UserError
from .depth import by_depth
from .estimate import Estimate, estimate_here, from_phases, pipeline_here, strategy_of, traced_here
from .trace import Phases
from .trace_cache import cached


def estimate(cfg: Config, world: int = 1) -> Estimate:
    """The peak per rank of `cfg`'s training step on `world` processes (its parallel section says how)."""
    with FakeJobs(world) as jobs:
        return jobs.estimate(cfg)


class FakeJobs:
    """Estimates of jobs of `world` processes. `whole`: trace deep GPTs at their full depth (`depth.py`)."""

    def __init__(self, world: int, whole: bool = False, workers: int | None = None):
        self.world, self.whole = world, whole
        self._most = workers or usable_cpus()
        self._idle: queue.SimpleQueue[subprocess.Popen] = queue.SimpleQueue()
        self._started: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._pairs = ThreadPoolExecutor(self._most)  # the two depths of an estimate, side by side

    def __enter__(self) -> FakeJobs:
        return self

    def __exit__(self, *exc) -> None:
        self._pairs.shutdown()
        for worker in self._started:  # nothing is left to answer: no need to wait for a clean interpreter exit
            worker.kill()
            worker.wait()

    def estimate(self, cfg: Config) -> Estimate:
        kind = strategy_of(cfg, self.world)
        if kind == "one process":
            return estimate_here(cfg, 1, self.whole)
        if kind == "PP":
            return Estimate(kind, self.world, self._ask(cfg)["parts"])

        def trace(c: Config) -> Phases:
            return self._ask(c)["phases"]
        phases = trace(cfg) if self.whole else by_depth(cfg, trace, self._pairs.map)
        return from_phases(kind, self.world, phases)

    def _ask(self, cfg: Config) -> dict:
        answer = cached(cfg, self.world, lambda: self._ask_worker(cfg))
        if answer.get("user"):
            raise UserError(answer["error"])
        if "error" in answer:
            raise UserError(f"tracing the job as one of {self.world} processes failed: {answer['error']}")
        return answer

    def _ask_worker(self, cfg: Config) -> dict:
        worker = self._take()
        try:
            worker.stdin.write(json.dumps({"config": cfg.to_toml()}) + "\n")
            worker.stdin.flush()
            return json.loads(worker.stdout.readline() or '{"error": "the trace worker ended"}')
        finally:
            self._idle.put(worker)

    def _take(self) -> subprocess.Popen:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            with self._lock:
                if len(self._started) < self._most:
                    self._started.append(_start_worker(self.world))
                    return self._started[-1]
            return self._idle.get()


def _start_worker(world: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the worker is no rank of the caller's job
    return subprocess.Popen([sys.executable, "-m", "gpudl.memory.fake_jobs", str(world)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def _serve(world: int) -> None:
    """The worker: answer requests until stdin closes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..config import config_from_dict

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    # DTensor's advice on how a real run's collectives could be faster is not the planner's to give
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        for line in sys.stdin:
            try:
                cfg = config_from_dict(tomllib.loads(json.loads(line)["config"]))
                answer = {"parts": pipeline_here(cfg, world)} if strategy_of(cfg, world) == "PP" else \
                    {"phases": traced_here(cfg, world)}
            except UserError as e:
                answer = {"error": str(e), "user": True}
            except Exception as e:  # noqa: BLE001 -- the asking process reports it in one line
                answer = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
            print(json.dumps(answer), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
