"""The one sequence of stages every run walks, whichever origin its model and data have.

    open_run      session (device, process group, timeout) -> precision -> preflight checks ->
                  memory plan (a recipe's; fit plans later, on its module) -> layout (degrees, mesh) ->
                  peak FLOP/s for MFU -> memory limit enforced
    (the origin)  model, data, tuning, the job: a recipe builds them from its config (`recipe.py`),
                  `fit` takes the user's module and data (`fit.py`)
    run_prepared  checkpointer -> restore -> config.toml -> loader -> start block -> execute ->
                  how the run stopped, or what it leaves

A stage exists once, here, so an option given to a recipe or to `fit` reaches both the same way
(tests/unit/test_stages.py drives both through each shared one).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from ..checkpoint import Checkpointer
from ..config import Config
from ..data import DeviceLoader, first_batches
from ..data.loader import BatchSource, tensors_in
from ..device.peak import measured_peak_flops, peak_key
from ..distributed.parallelize import check_compile, compile_wanted
from ..distributed.preflight import check_job
from ..distributed.session import Session, plan_parallel, start_session
from ..memory.limit import enforce_memory_limit
from ..training.loop import Job, OutOfMemoryAtOneRow, TrainState
from ..training.precision import Precision, make_precision
from .autotune import MakeJob, job_identity
from .runner import Execution, Outcome, Workload, background_saves, execute


@dataclass
class Opened:
    """A run opened: the config as planned, this process's session and precision, and the memory limit."""

    cfg: Config
    session: Session
    precision: Precision
    console: Console   # quiet on every rank but rank 0
    limit: object | None = None  # the enforced memory limit (None: the device's own)


@contextmanager
def open_run(cfg: Config, console: Console, *, shard: Callable[[Config, Session, Precision], bool],
             plan: Callable[[Config, Session, Console], Config] | None = None,
             model: nn.Module | None = None) -> Iterator[Opened]:
    """Stages 1-7 of every run; the memory limit holds until the block ends.

    `shard(cfg, session, precision)`: whether data-parallel degrees left "auto" shard (FSDP);
    `plan(cfg, session, console)`: the config with a memory plan applied (a recipe's train.plan=auto);
    `model`: what the preflight checks split (a user's module; by default the recipe's)."""
    # the group is made before planning, and a plan may choose FSDP's CPU offload: ready for it then too
    may_offload = cfg.parallel.fsdp_cpu_offload or cfg.train.plan == "auto"
    session = start_session(cfg.run, console, cfg.parallel.timeout_s, offload=may_offload)
    console = console if session.is_writer else Console(quiet=True)
    precision = make_precision(cfg.train.precision, session.device)
    check_job(cfg, session.world, precision.name, model)
    if plan is not None:
        with session.during("plan agreement"):
            cfg = plan(cfg, session, console)
    check_compile(cfg.train.compile, session.device.type, session.world, cfg.parallel,
                  cfg.train.activation_checkpointing)
    with session.during("plan agreement"):
        plan_parallel(session, cfg.parallel, shard(cfg, session, precision))
    measured_peak_flops(session.device, peak_key(precision.name))  # for MFU; measured now, not under a limit
    with enforce_memory_limit(session.device, cfg.train.memory_limit,
                              compile_wanted(cfg.train.compile, session.device.type)) as limit:
        yield Opened(cfg, session, precision, console, limit)


def probe_jobs(source: BatchSource, session: Session, cfg: Config, identity: dict,
               make: Callable[[Config, Precision, Iterator], Job]) -> tuple[MakeJob, dict]:
    """What `autotune.tune` times: jobs `make(trial_cfg, precision, batches)` on the first step's data (as
    the loader makes it, repeated), and what identifies the job for the tuning cache."""
    step = next(first_batches(source, 1, session.device.torch_device))
    return (lambda trial, precision: make(trial, precision, itertools.repeat(step))), \
        job_identity(identity, tensors_in(step), cfg, session)


@dataclass
class Prepared:
    """What an origin hands `run_prepared`: the job, its data from batch 0, and where the run goes."""

    job: Job
    work: Workload
    source: BatchSource
    folder: Path | None                 # the run folder; None: nothing is written (fit without run_dir)
    checkpointer: Checkpointer | None
    resuming: bool
    restore: Callable[[Checkpointer, Job], tuple[TrainState, str | None]]  # (state, a line to say, or None)
    write_config: Callable[[Config], None]  # config.toml (and what else a resume reads) into the folder
    resume_how: str                     # how to continue a stopped run, in the origin's words
    loader_options: dict = field(default_factory=dict)  # DeviceLoader's num_workers and cores
    start_lines: list[str] = field(default_factory=list)  # the start block's lines this origin adds
    leave: Callable[[Job], None] | None = None  # what a finished run leaves (export, a sample)
    out_of_memory: Callable[[OutOfMemoryAtOneRow], BaseException] | None = None  # the error to raise instead


def run_prepared(opened: Opened, prep: Prepared) -> Outcome:
    """Stages 9-15: restore, config.toml, loader, start block, execute, how it stopped or what it leaves."""
    cfg, session, console = opened.cfg, opened.session, opened.console
    ckpt, job = prep.checkpointer, prep.job
    state, note = prep.restore(ckpt, job) if prep.resuming else (TrainState(), None)
    if prep.folder is not None and session.is_writer:
        prep.write_config(cfg)  # only now: a refused resume changes nothing
    # A user's DataLoader read again up to the resumed position draws from the RNG: the restored state must stay
    with torch.random.fork_rng(devices=[]):
        loader = DeviceLoader(prep.source, session.device.torch_device, start=state.batches, **prep.loader_options)
    job.batches = loader
    for line in [*prep.start_lines, f"Loader: {loader.description}", note]:
        if line:
            console.print(line, markup=False, soft_wrap=True)
    background = None
    if ckpt is not None:
        background, why = background_saves(cfg, session, ckpt, job)
        console.print(f"Checkpoint saves: {'in the background' if background else 'blocking'} ({why})", markup=False)
    if state.step:
        console.print(f"Resuming at step {state.step} (batch {state.batches}) from {prep.folder}", markup=False)
    try:
        outcome = execute(Execution(session, job, cfg, state, loader, prep.work, prep.folder, ckpt, background),
                          console)
    except OutOfMemoryAtOneRow as e:
        raise (prep.out_of_memory(e) if prep.out_of_memory is not None else e) from e
    finally:
        loader.close()
    if "stopped_by" in outcome.summary:  # preempted or interrupted: the checkpoint is all that is wanted now
        console.print(stopped_line(state, cfg, outcome.summary["stopped_by"], prep.folder, prep.resume_how),
                      markup=False, soft_wrap=True)
    elif prep.leave is not None:
        prep.leave(job)
    return outcome


def stopped_line(state: TrainState, cfg: Config, by: str, folder: Path | None, resume_how: str) -> str:
    """After a stop request: where the work is, and what continues it."""
    where = f"Stopped at step {state.step} of {cfg.train.max_steps} by {by}"
    if folder is None:
        return f"{where}; nothing saved (no run folder): {resume_how}"
    return f"{where}; checkpoint saved. Resume with: {resume_how}"
