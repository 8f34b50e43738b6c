"""Where this process stands in a job, read once from what the launcher set, and the process group.

torchrun (and `gpudl train --nproc-per-node`) sets RANK, WORLD_SIZE, LOCAL_RANK, ...;
SLURM's `srun` sets SLURM_PROCID, SLURM_NTASKS, ... . `read_env` is the one place that reads
them; everything else gets a `DistEnv`.

>>> read_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
DistEnv(rank=1, world_size=4, local_rank=1, local_world_size=2, restart_count=0, has_agent=False)
"""

from __future__ import annotations

import atexit
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..device.host import libc_function
from ..errors import UserError
from .rendezvous import check_in, tcp_store

PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int = 0     # how often torchrun has restarted the group (0: first attempt)
    has_agent: bool = False    # started by torchrun's agent, which restarts and stops the workers


def _first_slurm_host(nodelist: str) -> str:
    """'gpu[03-05,07],cpu1' -> 'gpu03': the first host of a SLURM node list."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """The job this process belongs to, or None when it runs alone."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env and "RANK" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                       int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                       int(env.get("TORCHELASTIC_RESTART_COUNT", 0)), "TORCHELASTIC_RUN_ID" in env)
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", 1)) > 1:
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                       int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]), 0)
    return None


def slurm_rendezvous(environ: Mapping[str, str]) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for a job started by srun without torchrun."""
    host = environ.get("MASTER_ADDR") or _first_slurm_host(environ.get("SLURM_JOB_NODELIST", "localhost"))
    port = int(environ.get("MASTER_PORT") or 20000 + int(environ.get("SLURM_JOB_ID", 0)) % 20000)
    return host, port


def _attempt_store(env: DistEnv, timeout_s: int) -> dist.Store:
    """The agent's store, with a key prefix of this attempt's own.

    torchrun's agent keeps one store for the whole job; without a prefix, a restarted group
    can read the addresses the previous attempt's processes published and hang connecting to them.
    """
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                          is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"gpudl/attempt_{env.restart_count}", agent)


def _job_store(env: DistEnv, timeout_s: int, init_method: str | None) -> dist.Store | None:
    """The store the group forms on: the agent's (this attempt's keys), else one rank 0 hosts at
    MASTER_ADDR:MASTER_PORT or SLURM's first node; None: torch's rendezvous at `init_method`."""
    if init_method is not None:
        return None
    if env.has_agent and "MASTER_ADDR" in os.environ:
        return _attempt_store(env, timeout_s)
    if "MASTER_ADDR" in os.environ:
        host, port = os.environ["MASTER_ADDR"], os.environ.get("MASTER_PORT")
        if port is None:
            raise UserError("MASTER_ADDR is set but MASTER_PORT is not: set both, or neither under SLURM")
    else:
        host, port = slurm_rendezvous(os.environ)
    return tcp_store(host, int(port), env.rank, env.world_size, timeout_s)


def init_process_group(env: DistEnv, backend: str, timeout_s: int, init_method: str | None = None) -> None:
    """Join the job's process group (a no-op when one is already initialised). Every rank first checks in
    on the job's store, so one that never arrives is named within `timeout_s` (`rendezvous.check_in`)."""
    if dist.is_initialized():
        return
    store = _job_store(env, timeout_s, init_method)
    if store is not None:
        check_in(store, env.rank, env.world_size, timeout_s)
    try:
        dist.init_process_group(backend, init_method=None if store else init_method, store=store, rank=env.rank,
                                world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:
        raise UserError(f"rank {env.rank} of {env.world_size} could not join the job's process group ({e}): "
                        f"check that every node can reach the rendezvous endpoint") from e
    atexit.register(_leave_process_group)


def join_alone(backend: str) -> None:
    """A process group of this process alone (no rendezvous: an in-memory store), for what torch only
    does over a group, such as FSDP's CPU offload on one device. A no-op when a group exists."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    """Destroy the group we joined while Python is still whole. Left to interpreter shutdown,
    the backend's threads can abort a finished process ("terminate called without an active
    exception"), and torchrun then counts a worker that succeeded as failed."""
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_agent() -> None:
    """Ask Linux to end this worker when its agent dies: an orphaned worker would wait forever."""
    prctl = libc_function("prctl")
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def check_devices(env: DistEnv, device_type: str) -> None:
    """One accelerator per local process: more processes than devices is a mistake, said early."""
    if device_type == "cpu":
        return
    count = torch.accelerator.device_count()
    if env.local_world_size > count:
        raise UserError(f"{env.local_world_size} processes per node but only {count} {device_type} device(s): "
                        f"use --nproc-per-node {count}")
