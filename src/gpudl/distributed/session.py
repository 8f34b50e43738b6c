"""This process's place in a job: its device, the process group, and the parallel layout.

A single process is the degenerate job: world 1, no process group, no mesh; unless it asks for
FSDP's CPU offload (a model larger than its one device), which FSDP runs over a group of one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from rich.console import Console
from torch.distributed.device_mesh import DeviceMesh

from ..config import ParallelConfig, RunConfig
from ..device import DeviceInfo, detect
from .agree import broadcast_json
from .env import DistEnv, check_devices, die_with_agent, init_process_group, join_alone, read_env
from .mesh import ParallelDims
from .watch import StepWatch
from ..device.accel import use_device
from ..device.host import keep_freed_memory
from ..errors import UserError

T = TypeVar("T")


@dataclass
class Session:
    device: DeviceInfo
    env: DistEnv | None = None
    dims: ParallelDims | None = None
    mesh: DeviceMesh | None = None
    dp_mesh: DeviceMesh | None = None   # the data-parallel ranks, flattened to one dimension
    timeout_s: int = 600
    control: dist.ProcessGroup | None = None  # a Gloo group of all ranks for host-side agreement (stop requests)
    _watch: StepWatch | None = field(default=None, repr=False)

    def watch(self) -> StepWatch | None:
        """Notes that turn a collective timeout into a named error (None for one process): one per job,
        from the start-up on, so start-up and steps report the same way."""
        if self.world == 1 or not dist.is_initialized():
            return None
        if self._watch is None:
            self._watch = StepWatch(self.rank, self.world, {}, self.timeout_s)
        if self.dims is not None:
            self._watch.set_layout({k: getattr(self.dims, k) for k in ("dp_replicate", "dp_shard", "tp", "pp")})
        return self._watch

    def during(self, phase: str, collective: str | None = None):
        """A start-up phase whose collectives, timing out after parallel.timeout_s, name themselves and the
        late rank (nothing to watch in one process)."""
        watch = self.watch()
        return watch.during(phase, collective) if watch is not None else nullcontext()

    @property
    def rank(self) -> int:
        return self.env.rank if self.env else 0

    @property
    def world(self) -> int:
        return self.env.world_size if self.env else 1

    @property
    def dp(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel world)."""
        return (self.dp_mesh.get_local_rank(), self.dp_mesh.size()) if self.dp_mesh is not None else (0, 1)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def agree(self, value):
        """Rank 0's `value` (plain data: JSON's types), on every rank."""
        return broadcast_json(value, self.control) if self.world > 1 else value

    def decided(self, decide: Callable[[], T]) -> T:
        """Rank 0's `decide()` (plain data) on every rank; a UserError it raised is raised on every rank:
        each hears the one line, none is left to find a lost connection."""
        answer = None
        if self.is_writer:
            try:
                answer = {"value": decide()}
            except UserError as e:
                answer = {"error": str(e)}
        answer = self.agree(answer)
        if "error" in answer:
            raise UserError(answer["error"])
        return answer["value"]

    def refuse(self, problem: Callable[[], str | None]) -> None:
        """Raise rank 0's `problem()` (a UserError's words; None: none) on every rank."""
        said = self.decided(problem)
        if said:
            raise UserError(said)

    def reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel ranks (identity for one process). Gloo has no AVG: sum, then divide."""
        if self.mesh is None or self.dp[1] == 1:
            return t
        t = t.detach().to(self.device.torch_device, torch.float32, copy=True)
        dist.all_reduce(t, group=self.dp_mesh.get_group())
        return t / self.dp[1]


def start_session(run: RunConfig, console: Console, timeout_s: int = 600, init_method: str | None = None,
                  offload: bool = False) -> Session:
    """Pick the device (one per local rank), join the job if there is one, and say so first.
    `offload`: the job may run FSDP's CPU offload (its group then also reduces on the CPU: `group_backend`)."""
    env = read_env()
    info = detect(run.device, local_rank=env.local_rank if env else None)
    if env is not None:
        if env.has_agent:
            die_with_agent()
        check_devices(env, info.type)
        use_device(info.torch_device)  # each rank on its own accelerator before the process group starts
        init_process_group(env, group_backend(info, offload), timeout_s, init_method)
    quiet = env is not None and env.rank != 0
    if not quiet:
        where = f" · {env.world_size} processes ({info.dist_backend})" if env else ""
        console.print(f"Using device: {info.label}{where}")
    if info.type == "cpu" and run.keep_host_memory and keep_freed_memory() and not quiet:
        console.print("Host memory: freed blocks are kept for the next step (glibc malloc tuned)")
    # The timeout is the job's: torch's default for a new group is 30 minutes, not the default group's.
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) \
        if env is not None and env.world_size > 1 else None
    return Session(info, env, timeout_s=timeout_s, control=control)


def group_backend(info: DeviceInfo, offload: bool) -> str:
    """The job's process-group backend: the device's own, and with FSDP's CPU offload on an accelerator
    Gloo beside it for CPU tensors. Clipping reduces the gradients' norm over the default group, and
    offloaded gradients (so their norm) live on the host, which NCCL and its peers cannot reduce."""
    if not offload or info.dist_backend == "gloo":
        return info.dist_backend
    return f"cpu:gloo,{info.torch_device.type}:{info.dist_backend}"


def plan_parallel(session: Session, cfg: ParallelConfig, shard: bool = False) -> Session:
    """Resolve the degrees for this job and build its mesh. `shard`: what data-parallel degrees left
    "auto" become, FSDP (True) or DDP (False); the memory planner decides it (`memory/auto.py`)."""
    session.dims = ParallelDims.resolve(dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, tp=cfg.tp, pp=cfg.pp,
                                        world=session.world, shard=shard)
    if session.world == 1 and cfg.fsdp_cpu_offload:  # FSDP over one process: its offload, on a group of one
        join_alone(group_backend(session.device, offload=True))
    if session.world > 1 or cfg.fsdp_cpu_offload:
        session.mesh, session.dp_mesh = session.dims.build_mesh(session.device.type)
    return session
