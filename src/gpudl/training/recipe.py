"""A training run from a config, stage by stage as DESIGN.md draws it.

config -> device -> model (meta, FLOPs counted) -> parallelize (which allocates it on the device) ->
data loader -> training loop -> metrics -> checkpoints -> export -> sample.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from .. import models
from ..checkpoint import Checkpointer, model_fingerprint
from ..checkpoint.files import check_like
from ..config import Config
from ..data import Data, DeviceLoader, build_data, first_batches
from ..distributed.parallelize import compile_wanted, parallelize
from ..distributed.parts import Parallelized
from .runner import Execution, execute
from ..errors import UserError
from ..observe.metrics import count_training_flops, meta_batch
from .optim import make_optimizer, make_scheduler
from .precision import Precision, make_precision
from .run_dir import after_training, resolve_run_dir
from .session import Session, plan_parallel, start_session
from .loop import Job, TrainState, standard_micro_step


@dataclass
class RunResult:
    """What a run leaves: its folder, summary figures, metric records and the trained model."""

    run_dir: Path | None
    summary: dict
    records: list[dict]
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None


def model_and_data(cfg: Config, rank: int = 0, world: int = 1) -> tuple[models.ModelSpec, Data]:
    spec = models.resolve(cfg.model.name, cfg.model.overrides)
    data = build_data(cfg.data, spec, cfg.train.batch_size, cfg.run.seed, rank, world)
    for key, value in data.model_fit.items():
        if key in cfg.model.overrides and cfg.model.overrides[key] != value:
            raise UserError(f"model.{key}={cfg.model.overrides[key]} does not match the data, which has {value}: "
                            f"drop the setting or set --set model.{key}={value}")
    if data.model_fit:
        spec = models.resolve(cfg.model.name, {**data.model_fit, **cfg.model.overrides})
    return spec, data


def eval_fn_for(spec: models.ModelSpec):
    """Evaluation metrics: loss for every model, accuracy too for classifiers."""
    if spec.is_language_model:
        return lambda model, batch: {"loss": model(batch[0], batch[1])}

    def classify(model, batch):
        logits = model(batch[0]).float()
        return {"loss": F.cross_entropy(logits, batch[1]),
                "accuracy": (logits.argmax(-1) == batch[1]).float().mean()}
    return classify


def build_model(spec: models.ModelSpec, data: Data, session: Session, precision: Precision,
                cfg: Config) -> tuple[Parallelized, int]:
    """(model placed and parallelized for this job, training FLOPs per sample counted on the meta device)."""
    meta = models.build_meta(spec)
    sample = meta_batch(data.train.batch(0))
    flops = count_training_flops(meta, sample, models.loss_for(spec)) // cfg.train.batch_size
    info = session.device
    # Allocated by parallelize, which knows what this rank holds (a pipeline rank: its stages only).
    materialize = functools.partial(models.materialize, device=info.torch_device, dtype=precision.param_dtype,
                                    seed=cfg.run.seed)
    placed = parallelize(models.build_meta(spec), activation_checkpointing=cfg.train.activation_checkpointing,
                         compile=compile_wanted(cfg.train.compile, info.type), dims=session.dims, mesh=session.mesh,
                         precision_name=precision.name, cfg=cfg.parallel, device=info.torch_device,
                         materialize=materialize, batch_size=cfg.train.batch_size)
    return placed, flops


def _follow_config_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, peak_lr: float) -> None:
    """The schedule goes on from where it was, but at the config's peak lr: a resumed run's
    `--set optim.lr=...` takes effect (the restored state would keep the old one). Unchanged,
    the lr is computed exactly as the schedule computed it, so resuming stays bit-identical."""
    scheduler.base_lrs = [peak_lr] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = peak_lr
        group["lr"] = peak_lr * factor(scheduler.last_epoch)


def _restore(ckpt: Checkpointer, job: Job, peak_lr: float) -> TrainState:
    path = ckpt.latest()
    if path is None:
        raise UserError(f"nothing to resume: {ckpt.folder} holds no complete checkpoint; start a new run instead")
    extra = ckpt.load(path, job.model, job.optimizer)
    job.scheduler.load_state_dict(check_like(path, "scheduler", extra.get("scheduler"), job.scheduler.state_dict()))
    _follow_config_lr(job.scheduler, peak_lr)
    scaler, live = extra.get("scaler", {}), job.precision.state_dict()
    job.precision.load_state_dict(check_like(path, "scaler", scaler, live) if scaler and live else {})
    return TrainState(**extra["train_state"])


def _make_job(spec, placed: Parallelized, precision: Precision, data: Data, cfg: Config, device) -> Job:
    optimizer = make_optimizer(placed.model, cfg.optim, device.type)
    return Job(model=placed.model, loss_fn=models.loss_for(spec), optimizer=optimizer,
               scheduler=make_scheduler(optimizer, cfg.optim, cfg.train.max_steps), precision=precision,
               batches=iter(()), eval_fn=placed.eval_fn or eval_fn_for(spec),
               eval_batches=(lambda: first_batches(data.val, data.eval_batches(cfg.train.eval_batches), device))
               if data.val else None,
               grad_sync=placed.grad_sync, micro_step=placed.micro_step or standard_micro_step,
               clip_norm=placed.clip_norm)


def train(cfg: Config, resume: str | Path | None = None, console: Console | None = None) -> RunResult:
    """Train the model a config describes; `resume` continues the run in that folder.

    `resume="auto"` continues run `run.name` if it has a checkpoint and starts it otherwise
    (what a restarted multi-process job does).

    >>> from gpudl.config import load_config
    >>> cfg = load_config(None, ["train.max_steps=2", "run.dir=/tmp/gpudl-doctest", "sample.tokens=0"])
    >>> train(cfg, console=Console(quiet=True)).summary["steps"]
    2
    """
    console = console or Console()
    session = start_session(cfg.run, console, cfg.parallel.timeout_s)
    if not session.is_writer:
        console = Console(quiet=True)
    precision = make_precision(cfg.train.precision, session.device)
    meta = models.build_meta(models.resolve(cfg.model.name, cfg.model.overrides))
    if cfg.parallel.tp > 1:  # before any process counting: no number of processes fixes the model
        from ..distributed.tensor import check_tp

        check_tp(meta, cfg.parallel.tp, cfg.parallel.tp_sequence_parallel)
    if cfg.parallel.pp > 1:  # likewise for what no pipeline can run
        from ..distributed.pipeline import check_pipeline

        check_pipeline(meta, cfg.parallel, cfg.train.batch_size, precision.name)
    plan_parallel(session, cfg.parallel, sum(p.numel() for p in meta.parameters()))
    spec, data = model_and_data(cfg, *session.dp)
    run_dir, resuming = resolve_run_dir(cfg, resume, session)
    placed, flops_per_sample = build_model(spec, data, session, precision, cfg)
    device = session.device.torch_device
    job = _make_job(spec, placed, precision, data, cfg, device)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, model_fingerprint(spec.name, spec.config),
                        is_writer=session.is_writer)
    state = _restore(ckpt, job, cfg.optim.lr) if resuming else TrainState()
    if session.is_writer:
        (run_dir / "config.toml").write_text(cfg.to_toml())  # only now: a refused resume changes nothing
    loader = DeviceLoader(data.train, device, start=state.batches, num_workers=cfg.data.num_workers)
    job.batches = loader
    _announce(console, session, precision, spec, data, job.model, state)
    ex = Execution(session=session, job=job, train=cfg.train, log=cfg.log, state=state, loader=loader,
                   model_name=spec.name, unit=data.unit, units_per_sample=data.units_per_sample,
                   flops_per_sample=flops_per_sample, run_dir=run_dir, checkpointer=ckpt,
                   save_every=cfg.checkpoint.every,
                   n_params=sum(p.numel() for p in models.build_meta(spec).parameters()))
    result = execute(ex, console)
    if "stopped_by" in result.summary:  # preempted or interrupted: the checkpoint is all that is wanted now
        console.print(f"Stopped at step {state.step} of {cfg.train.max_steps} by {result.summary['stopped_by']}; "
                      f"checkpoint saved. Resume with: {resume_command(session, run_dir)}", markup=False, soft_wrap=True)
    else:
        after_training(cfg, spec, job.model, ckpt, session, run_dir, console)
    return RunResult(run_dir, result.summary, result.records, job.model, job.optimizer)


def resume_command(session: Session, run_dir: Path) -> str:
    """The command that continues this run with the same processes."""
    env = session.env
    if env is None or not env.has_agent:
        return shlex.join(["gpudl", "train", "--resume", str(run_dir)])
    nodes = ["--nnodes", str(env.world_size // env.local_world_size)] if env.world_size > env.local_world_size else []
    return shlex.join(["gpudl", "train", "--nproc-per-node", str(env.local_world_size), *nodes,
                       "--resume", str(run_dir)])


def _announce(console, session: Session, precision: Precision, spec, data: Data, model, state) -> None:
    n = sum(p.numel() for p in models.build_meta(spec).parameters())
    console.print(f"Precision: {precision.name} ({precision.reason})")
    console.print(f"Model: {spec.name}: {models.describe(spec)}; {n / 1e6:.2f}M parameters")
    if session.world > 1:
        console.print(f"Parallel: {session.dims.describe()} over {session.world} processes")
    console.print(f"Data: {data.description}")
    if data.val is None:
        console.print(f"Evaluation: none, the data has no validation part ({data.no_val})", markup=False,
                      soft_wrap=True)
    if state.step:
        console.print(f"Resuming at step {state.step} (batch {state.batches})")
