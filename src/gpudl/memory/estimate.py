"""Peak memory of a training step per rank, for every strategy gpudl runs, before anything is allocated.

One process, FSDP2 (and HSDP) and tensor parallelism are traced (`trace.py`): the one-process
job as it is, the others as rank 0 of a job of `world` fake processes, which needs torch's fake
process group as the default group: `fake_jobs.py` runs these estimates in worker processes
that have one (so the caller's own group, if it has one, is left alone). DDP cannot be traced
so: its rank is the one-process job with DDP's gradient buckets modelled in the trace
(`trace._DDPBuckets`). Nor can a pipeline schedule (its stages exchange shapes): each rank's
stages are traced on their own and the schedule's order combines them by formula
(`pipeline.py`); a pipeline job's estimate is its rank with the largest peak. With data or tensor
parallelism beside the pipeline, the stages are traced as rank 0 of those groups, on the fake
process group. The others, of a deep GPT, are traced at 4 and 5 blocks and extrapolated (`depth.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import Config
from ..device import cpu_info  # traces run on the CPU's fake tensors; accelerators: see plan.py's reserve
from ..distributed.mesh import ParallelDims
from .depth import by_depth
from .offload import on_device
from .trace import Phases, at_peak


@dataclass(frozen=True)
class Estimate:
    """Predicted peak of live tensor bytes on one rank during a steady training step, by what holds them."""

    strategy: str                          # "one process", "DDP", "FSDP", "HSDP", "TP", ...
    world: int
    parts: dict[str, int] = field(default_factory=dict)   # trace.CATEGORIES -> bytes at the peak
    host_peak: int = 0                     # FSDP's CPU offload: the most it holds in host memory, over the step

    @property
    def peak(self) -> int:
        """On the device: what FSDP's CPU offload keeps in host memory ("host") is not counted."""
        return on_device(self.parts)

    @property
    def host(self) -> int:
        """Host memory that CPU offload needs: its own peak (in the update, where the device's is not)."""
        return max(self.host_peak, self.parts.get("host", 0))


def from_phases(strategy: str, world: int, phases: Phases) -> Estimate:
    """The estimate of a traced step: the device's peak, and the host's."""
    return Estimate(strategy, world, at_peak(phases), max(p.get("host", 0) for p in phases.values()))


def dims_of(cfg: Config, world: int) -> ParallelDims:
    p = cfg.parallel
    return ParallelDims.resolve(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, world=world)


def strategy_of(cfg: Config, world: int) -> str:
    """The strategy's name: "one process", "DDP", "FSDP", "HSDP", "TP", "TP+FSDP" or "PP"."""
    d = dims_of(cfg, world)
    offload = cfg.parallel.fsdp_cpu_offload  # FSDP's, even over one process or replicas (`distributed/parallelize.py`)
    if world == 1 and not offload:
        return "one process"
    if d.pp > 1:
        return "PP"
    if d.tp > 1:
        return "TP+FSDP" if d.dp > 1 else "TP"
    if d.dp_shard > 1 or offload:
        return "HSDP" if d.dp_replicate > 1 else "FSDP"
    return "DDP"


def estimate_here(cfg: Config, world: int, whole: bool = False) -> Estimate:
    """`fake_jobs.estimate`, in this process (`traced_here`: what a job of several processes needs), one trace
    after the other. `whole`: trace a deep GPT at its full depth, not from traces of 4 and 5 blocks
    (`depth.py`)."""
    from .trace_cache import cached

    kind = strategy_of(cfg, world)
    if kind == "PP":
        return Estimate(kind, world, cached(cfg, world, lambda: {"parts": pipeline_here(cfg, world)})["parts"])

    def trace(c: Config) -> Phases:
        return cached(c, world, lambda: {"phases": traced_here(c, world)})["phases"]
    return from_phases(kind, world, trace(cfg) if whole else by_depth(cfg, trace))


def traced_here(cfg: Config, world: int) -> Phases:
    """One trace of the step, at the model's depth, in this process: a job of several processes as
    its rank 0, which needs torch's fake process group of `world` processes as the default group."""
    if strategy_of(cfg, world) in ("one process", "DDP"):
        return _one_process(cfg, ddp=world > 1)
    return _as_rank_zero(cfg, world)


def _one_process(cfg: Config, ddp: bool) -> Phases:
    from ..training.job import model_and_shapes
    from ..distributed.session import Session
    from .trace import trace_step

    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_replicate=1, dp_shard=1, tp=1,
                                                                  pp=1))
    _, data = model_and_shapes(single)
    return trace_step(single, Session(cpu_info()), data.train.batch(0), ddp=ddp)


def _as_rank_zero(cfg: Config, world: int) -> Phases:
    """Rank 0 of `world` processes; their collectives go to the default group, torch's fake one."""
    from ..distributed.env import DistEnv
    from ..training.job import model_and_shapes
    from ..distributed.session import Session, plan_parallel
    from .trace import trace_step

    session = Session(cpu_info(), env=DistEnv(0, world, 0, world))
    plan_parallel(session, cfg.parallel)
    _, data = model_and_shapes(cfg, *session.dp)
    return trace_step(cfg, session, data.train.batch(0))


def pipeline_here(cfg: Config, world: int) -> dict[str, int]:
    """The pipeline rank with the largest peak (`pipeline.py`); every rank of a pipeline reads the batch.
    With data or tensor parallelism beside it, this process must have the fake process group of `world`
    (`fake_jobs.py`): its stages are parallelized as rank 0's."""
    from ..distributed.env import DistEnv
    from ..training.job import model_and_shapes
    from ..distributed.session import Session, plan_parallel
    from .pipeline import rank_peaks

    session = None
    if dims_of(cfg, world).pp != world:
        session = Session(cpu_info(), env=DistEnv(0, world, 0, world))
        plan_parallel(session, cfg.parallel)
    _, data = model_and_shapes(cfg)
    return max(rank_peaks(cfg, data.train.batch(0), session), key=on_device)
