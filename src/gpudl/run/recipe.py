"""A training run from a recipe (`gpudl.train`), stage by stage as DESIGN.md draws it.

config -> device -> preflight checks -> layout -> model (meta, FLOPs counted) -> build_job (which
allocates it on the device) -> data loader -> training loop -> metrics -> checkpoints -> export -> sample.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from .. import models
from ..checkpoint import Checkpointer, model_fingerprint
from ..config import Config
from ..data import Data, DeviceLoader, first_batches, usable_cores
from ..data.loader import tensors_in
from ..device.peak import measured_peak_flops, peak_key
from ..distributed.parallelize import check_compile, compile_wanted
from ..distributed.preflight import check_job
from ..errors import UserError
from ..memory.auto import planned, shard_wanted
from ..memory.limit import enforce_memory_limit
from ..observe.flops import count_training_flops, meta_batch
from .autotune import MakeJob, Tuned, job_identity, tune
from ..training.job import Task, build_job, model_and_data
from ..training.loop import Job, OutOfMemoryAtOneRow, TrainState
from ..training.precision import Precision, make_precision
from .run_dir import after_training, keep_tokenizer, kept_tokenizer, resolve_run_dir, restore_job
from .runner import Execution, Workload, background_saves, execute
from ..distributed.session import Session, plan_parallel, start_session


@dataclass
class RunResult:
    """What a run leaves: its folder, summary figures, metric records and the trained model."""

    run_dir: Path | None
    summary: dict
    records: list[dict]
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None


def eval_fn_for(spec: models.ModelSpec):
    """Evaluation metrics: loss for every model, accuracy too for classifiers."""
    if spec.is_language_model:
        return lambda model, batch: {"loss": model(batch[0], batch[1])}

    def classify(model, batch):
        logits = model(batch[0]).float()
        return {"loss": F.cross_entropy(logits, batch[1]),
                "accuracy": (logits.argmax(-1) == batch[1]).float().mean()}
    return classify


def recipe_job(cfg: Config, spec: models.ModelSpec, data: Data, session: Session,
               precision: Precision) -> tuple[Job, Workload]:
    """The job of a recipe's model and data (through `build_job`), and what a sample costs.

    The model comes on the meta device: FLOPs are counted there, and `parallelize` allocates only
    what this rank holds (a pipeline rank: its stages), with the whole model's initial values.
    """
    meta = models.build_meta(spec)
    micro = tuple(t[:cfg.train.batch_size] for t in data.train.batch(0))
    flops = count_training_flops(meta, meta_batch(micro), models.loss_for(spec))
    device = session.device.torch_device
    val = data.val
    task = Task(models.loss_for(spec), eval_fn=eval_fn_for(spec),
                eval_batches=(lambda: first_batches(val, data.eval_batches(cfg.train.eval_batches), device))
                if val else None, micro_batch=cfg.train.batch_size)
    materialize = functools.partial(models.materialize, device=device, dtype=precision.param_dtype, seed=cfg.run.seed)
    job = build_job(models.build_meta(spec), cfg, session, precision, task, materialize)
    work = Workload(spec.name, data.unit, data.units_per_sample, flops // cfg.train.batch_size,
                    n_params=sum(p.numel() for p in meta.parameters()))
    return job, work


def probe_job(cfg: Config, spec: models.ModelSpec, data: Data, session: Session) -> tuple[MakeJob, dict]:
    """What `autotune.tune` times: jobs of the recipe's model on the first step's data (as the loader makes
    it), each a fresh model at the run's seed, and what identifies the job for its cache."""
    device = session.device.torch_device
    step = next(first_batches(data.train, 1, device))

    def make_job(trial: Config, precision: Precision) -> Job:
        materialize = functools.partial(models.materialize, device=device, dtype=precision.param_dtype,
                                        seed=cfg.run.seed)
        task = Task(models.loss_for(spec), batches=itertools.repeat(step), micro_batch=trial.train.batch_size)
        return build_job(models.build_meta(spec), trial, session, precision, task, materialize)
    return make_job, job_identity({"name": spec.name, **dataclasses.asdict(spec.config)}, tensors_in(step), cfg,
                                  session)


def train(cfg: Config, resume: str | Path | None = None, console: Console | None = None,
          probe_on_cpu: bool = False) -> RunResult:
    """Train the model a config describes; `resume` continues the run in that folder.

    `resume="auto"` continues run `run.name` if it has a checkpoint and starts it otherwise
    (what a restarted multi-process job does). `probe_on_cpu` (internal, for tests: no config key or
    option reaches it): time precision and compile candidates on the CPU too, as on a GPU
    (`run/autotune.py`).

    >>> from gpudl.config import load_config
    >>> cfg = load_config(None, ["train.max_steps=2", "run.dir=/tmp/gpudl-doctest", "sample.tokens=0"])
    >>> train(cfg, console=Console(quiet=True)).summary["steps"]
    2
    """
    console = console or Console()
    # the group is made before planning, and a plan may choose FSDP's CPU offload: ready for it then too
    may_offload = cfg.parallel.fsdp_cpu_offload or cfg.train.plan == "auto"
    session = start_session(cfg.run, console, cfg.parallel.timeout_s, offload=may_offload)
    if not session.is_writer:
        console = Console(quiet=True)
    precision = make_precision(cfg.train.precision, session.device)
    check_job(cfg, session.world, precision.name)
    with session.during("plan agreement"):
        cfg = planned(cfg, session, console)
    check_compile(cfg.train.compile, session.device.type, session.world, cfg.parallel,
                  cfg.train.activation_checkpointing)
    measured_peak_flops(session.device, peak_key(precision.name))  # for MFU; measured now, not under a limit
    compiled = compile_wanted(cfg.train.compile, session.device.type)
    with enforce_memory_limit(session.device, cfg.train.memory_limit, compiled):
        return _train(cfg, session, precision, resume, console, probe_on_cpu)


def _train(cfg: Config, session: Session, precision: Precision, resume, console: Console,
           probe_on_cpu: bool) -> RunResult:
    with session.during("plan agreement"):
        plan_parallel(session, cfg.parallel, shard_wanted(cfg, session))
        spec, data = model_and_data(cfg, *session.dp, tokenizer=kept_tokenizer(cfg, resume))
        run_dir, resuming = resolve_run_dir(cfg, resume, session)
    with session.during("model set-up"):
        # precision and compile "auto" on a GPU: timed on throw-away jobs before the run's own is made
        tuned = tune(cfg, session, precision, lambda: probe_job(cfg, spec, data, session), probe_on_cpu)
        cfg, precision = tuned.cfg, tuned.precision
        job, work = recipe_job(cfg, spec, data, session, precision)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, model_fingerprint(spec.name, spec.config),
                        is_writer=session.is_writer, watch=session.watch())
    state, rng_note = restore_job(ckpt, job, cfg, session.world) if resuming else (TrainState(), None)
    if session.is_writer:
        (run_dir / "config.toml").write_text(cfg.to_toml())  # only now: a refused resume changes nothing
        keep_tokenizer(run_dir, data.tokenizer)  # what evaluate, generate, export and a resume read
    ranks_here = session.env.local_world_size if session.env is not None else 1
    loader = DeviceLoader(data.train, session.device.torch_device, start=state.batches,
                          num_workers=cfg.data.num_workers, cores=max(1, usable_cores() // ranks_here))
    job.batches = loader
    _announce(console, session, tuned, spec, work, data, state, cfg.parallel.fsdp_cpu_offload)
    console.print(f"Loader: {loader.description}", markup=False, soft_wrap=True)
    if rng_note:
        console.print(rng_note, markup=False, soft_wrap=True)
    background, why = background_saves(cfg, session, ckpt, job)
    console.print(f"Checkpoint saves: {'in the background' if background else 'blocking'} ({why})", markup=False)
    ex = Execution(session, job, cfg, state, loader, work, run_dir, ckpt, background)
    try:
        result = execute(ex, console)
    except OutOfMemoryAtOneRow as e:
        raise out_of_memory_report(e, cfg, session, precision) from e
    finally:
        loader.close()
    if "stopped_by" in result.summary:  # preempted or interrupted: the checkpoint is all that is wanted now
        console.print(f"Stopped at step {state.step} of {cfg.train.max_steps} by {result.summary['stopped_by']}; "
                      f"checkpoint saved. Resume with: {resume_command(session, run_dir)}", markup=False, soft_wrap=True)
    else:
        after_training(cfg, spec, job.model, ckpt, session, run_dir, console)
    return RunResult(run_dir, result.summary, result.records, job.model, job.optimizer)


def out_of_memory_report(e: OutOfMemoryAtOneRow, cfg: Config, session: Session, precision: Precision) -> UserError:
    """The run's error with where its memory goes and the fixes ranked (rank 0 traces; the others just stop)."""
    if not session.is_writer:
        return e
    from ..memory.oom import explain

    asked = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision.name))
    return UserError(f"{e}; {explain(asked, session.world)}")


def resume_command(session: Session, run_dir: Path) -> str:
    """The command that continues this run with the same processes."""
    env = session.env
    if env is None or not env.has_agent:
        return shlex.join(["gpudl", "train", "--resume", str(run_dir)])
    nodes = ["--nnodes", str(env.world_size // env.local_world_size)] if env.world_size > env.local_world_size else []
    return shlex.join(["gpudl", "train", "--nproc-per-node", str(env.local_world_size), *nodes,
                       "--resume", str(run_dir)])


def _announce(console, session: Session, tuned: Tuned, spec, work: Workload, data: Data, state,
              offload: bool) -> None:
    console.print(f"Precision: {tuned.precision.describe()}", markup=False, soft_wrap=True)
    console.print(f"Compile: {tuned.compile_note}", markup=False, soft_wrap=True)
    console.print(f"Model: {spec.name}: {models.describe(spec)}; {work.n_params / 1e6:.2f}M parameters")
    if session.world > 1:
        console.print(f"Parallel: {session.dims.describe()} over {session.world} processes")
    if offload:
        here = " (on the CPU that saves nothing: its memory is the host's)" if session.device.type == "cpu" else ""
        console.print(f"FSDP CPU offload: weights, gradients and optimizer state in host memory; the update runs "
                      f"there{here}")
    console.print(f"Data: {data.description}")
    if data.val is None:
        console.print(f"Evaluation: none, the data has no validation part ({data.no_val})", markup=False,
                      soft_wrap=True)
    if state.step:
        console.print(f"Resuming at step {state.step} (batch {state.batches})")
