"""Peak memory of a training step per rank, for every strategy gpudl runs, before anything is allocated.

One process, FSDP2 (and HSDP) and tensor parallelism are traced (`trace.py`): the one-process
job in this process, the others as rank 0 of a job of `world` fake processes, in a worker
process whose default group is torch's fake process group (so this process's own group, if it
has one, is left alone). DDP cannot be traced so: its rank is the one-process job with DDP's
gradient buckets modelled in the trace (`trace._DDPBuckets`). Nor can a pipeline schedule (its
stages exchange shapes): each rank's stages are traced on their own, in this process, and the
schedule's order combines them by formula (`pipeline.py`); a pipeline job's estimate is its rank
with the largest peak. Pipelines with data or tensor parallelism beside them are not estimated yet.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from ..config import Config
from ..device import DeviceInfo, cpu_info
from ..distributed.mesh import ParallelDims
from ..errors import UserError


@dataclass(frozen=True)
class Estimate:
    """Predicted peak of live tensor bytes on one rank during a steady training step, by what holds them."""

    strategy: str                          # "one process", "DDP", "FSDP", "HSDP", "TP", ...
    world: int
    parts: dict[str, int] = field(default_factory=dict)   # trace.CATEGORIES -> bytes at the peak

    @property
    def peak(self) -> int:
        return sum(self.parts.values())


def dims_of(cfg: Config, world: int) -> ParallelDims:
    p = cfg.parallel
    return ParallelDims.resolve(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, world=world)


def strategy_of(cfg: Config, world: int) -> str:
    """The strategy's name: "one process", "DDP", "FSDP", "HSDP", "TP", "TP+FSDP" or "PP"."""
    d = dims_of(cfg, world)
    if world == 1:
        return "one process"
    if d.pp > 1:
        return "PP"
    if d.tp > 1:
        return "TP+FSDP" if d.dp > 1 else "TP"
    if d.dp_shard > 1:
        return "HSDP" if d.dp_replicate > 1 else "FSDP"
    return "DDP"


def estimate(cfg: Config, world: int = 1) -> Estimate:
    """The peak per rank of `cfg`'s training step on `world` processes (its parallel section says how)."""
    with FakeJobs(world) as jobs:
        return jobs.estimate(cfg)


class FakeJobs:
    """Estimates on `world` processes. Traces that need a job of fake processes run in one worker
    process, started on first need and kept for every later estimate (a planner asks for many)."""

    def __init__(self, world: int):
        self.world, self._worker = world, None

    def __enter__(self) -> FakeJobs:
        return self

    def __exit__(self, *exc) -> None:
        if self._worker is not None:
            self._worker.stdin.close()
            self._worker.wait(timeout=60)

    def estimate(self, cfg: Config) -> Estimate:
        kind = strategy_of(cfg, self.world)
        if kind == "PP":
            return Estimate(kind, self.world, _pipeline(cfg, self.world))
        if kind in ("one process", "DDP"):
            return Estimate(kind, self.world, _one_process(cfg, ddp=kind == "DDP"))
        return Estimate(kind, self.world, self._traced(cfg))

    def _traced(self, cfg: Config) -> dict[str, int]:
        if self._worker is None:
            self._worker = _start_worker(self.world)
        self._worker.stdin.write(json.dumps({"config": cfg.to_toml()}) + "\n")
        self._worker.stdin.flush()
        answer = json.loads(self._worker.stdout.readline() or '{"error": "the trace worker ended"}')
        if "error" in answer:
            raise UserError(f"tracing the job as one of {self.world} processes failed: {answer['error']}")
        return answer["parts"]


def _start_worker(world: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the worker is no rank of the caller's job
    return subprocess.Popen([sys.executable, "-m", "gpudl.memory.trace_worker", str(world)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def _one_process(cfg: Config, ddp: bool) -> dict[str, int]:
    from ..training.job import model_and_data
    from ..training.session import Session
    from .trace import trace_step

    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_replicate=1, dp_shard=1, tp=1,
                                                                  pp=1))
    _, data = model_and_data(single)
    return trace_step(single, Session(_device(cfg)), data.train.batch(0), ddp=ddp)


def _pipeline(cfg: Config, world: int) -> dict[str, int]:
    """The pipeline rank with the largest peak (`pipeline.py`) of a pipeline-only job; every rank reads the batch."""
    from ..training.job import model_and_data
    from .pipeline import rank_peaks

    d = dims_of(cfg, world)
    if d.pp != world:
        raise UserError(f"parallel.pp={d.pp} with data or tensor parallelism beside it (dp={d.dp}, tp={d.tp}): the "
                        f"memory of such a job is not estimated yet; plan it with --set parallel.pp={world} or pp=1")
    _, data = model_and_data(cfg)
    return max(rank_peaks(cfg, data.train.batch(0)), key=lambda parts: sum(parts.values()))


def _device(cfg: Config) -> DeviceInfo:
    return cpu_info()  # traces run on the CPU's fake tensors; accelerators: see plan.py's reserve
