"""A training run from a recipe (`gpudl.train`): the model and data its config describes, through the
stages every run walks (`stages.py`).

open_run (session, precision, preflight, memory plan, layout, peak, limit) -> model and data from the
config -> tune -> build_job (the model on the meta device, FLOPs counted there, then allocated) ->
run_prepared (checkpoints, restore, config.toml, loader, loop, metrics) -> export and a sample.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from .. import models
from ..checkpoint import Checkpointer, model_fingerprint
from ..config import Config
from ..data import Data, first_batches, usable_cores
from ..distributed.session import Session
from ..errors import UserError
from ..memory.auto import planned, shard_wanted
from ..observe.flops import count_training_flops, meta_batch
from ..training.job import Task, build_job, model_and_data
from ..training.loop import Job, OutOfMemoryAtOneRow
from ..training.precision import Precision
from .autotune import MakeJob, Tuned, tune
from .fit_loss import eval_fn_for
from ..interop.init_from import read_source, with_source
from ..interop.pretrained import Pretrained, load_into, weights_for
from .run_dir import (CLI, after_training, keep_tokenizer, kept_tokenizer, recipe_folder, resolve_run, restore_job,
                      resumed_folder)
from .runner import Workload
from .stages import Opened, Prepared, open_run, probe_jobs, run_prepared


@dataclass
class RunResult:
    """What a run leaves: its folder, summary figures, metric records and the trained model."""

    run_dir: Path | None
    summary: dict
    records: list[dict]
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None


def recipe_job(cfg: Config, spec: models.ModelSpec, data: Data, session: Session,
               precision: Precision, weights: dict | None = None) -> tuple[Job, Workload]:
    """The job of a recipe's model and data (through `build_job`), and what a sample costs.

    The model comes on the meta device: FLOPs are counted there, and `parallelize` allocates only
    what this rank holds (a pipeline rank: its stages), with the whole model's initial values, or
    `weights` (model.init_from's, in gpudl's names) copied in before any sharding, so every layout
    starts from them.
    """
    meta = models.build_meta(spec)
    micro = tuple(t[:cfg.train.batch_size] for t in data.train.batch(0))
    flops = count_training_flops(meta, meta_batch(micro), models.loss_for(spec))
    device = session.device.torch_device
    val = data.val
    task = Task(models.loss_for(spec), eval_fn=evaluation_for(spec, meta),
                eval_batches=(lambda: first_batches(val, data.eval_batches(cfg.train.eval_batches), device))
                if val else None, micro_batch=cfg.train.batch_size)
    materialize = functools.partial(models.materialize, device=device, dtype=precision.param_dtype, seed=cfg.run.seed)
    if weights is not None:
        materialize = _then_load(materialize, weights)
    job = build_job(models.build_meta(spec), cfg, session, precision, task, materialize)
    work = Workload(spec.name, data.unit, data.units_per_sample, flops // cfg.train.batch_size,
                    n_params=sum(p.numel() for p in meta.parameters()))
    return job, work


def _then_load(materialize, weights: dict):
    """`materialize`, then model.init_from's weights copied in: `parallelize` calls it where the model is
    still whole (before tp, FSDP or DDP; a pipeline rank's share), so every layout splits those weights."""
    def allocate_and_load(model: nn.Module, only=None) -> nn.Module:
        return load_into(materialize(model, only=only), weights)
    return allocate_and_load


def evaluation_for(spec: models.ModelSpec, model: nn.Module):
    """Evaluation metrics, as `fit` computes them: the model's own loss for a GPT, cross-entropy and
    accuracy for a classifier."""
    if spec.is_language_model:
        return eval_fn_for(None, model, None)
    return eval_fn_for(lambda logits, y: F.cross_entropy(logits.float(), y), model,
                       lambda logits, y: {"accuracy": (logits.argmax(-1) == y).float().mean()})


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
    pre = _pretrained(cfg, resume)
    if pre is not None:  # the source's model settings, before the plan and the preflight see the model
        cfg = with_source(cfg, pre)
    with open_run(cfg, console or Console(), plan=planned, shard=lambda c, s, _: shard_wanted(c, s)) as opened:
        return _train(opened, resume, probe_on_cpu, pre)


def _pretrained(cfg: Config, resume) -> Pretrained | None:
    """model.init_from's source (interop/init_from.py: a Hugging Face folder, a torchvision state dict, a
    gpudl run or export), read once, for a run that starts: a fine-tune, with a new optimizer, schedule
    and step 0. A resumed run continues from its own checkpoint and tokenizer (its config.toml already
    has the source's settings), even if the source is gone."""
    if cfg.model.init_from is None or resumed_folder(cfg, resume) is not None:
        return None
    return read_source(cfg.model.init_from)


def _train(opened: Opened, resume, probe_on_cpu: bool, pre: Pretrained | None = None) -> RunResult:
    cfg, session, console = opened.cfg, opened.session, opened.console
    with session.during("plan agreement"):
        tokenizer = pre.tokenizer if pre is not None else kept_tokenizer(cfg, resume)
        spec, data = model_and_data(cfg, *session.dp, tokenizer=tokenizer)
        wanted = recipe_folder(cfg, session) if cfg.run.name or resume != "auto" else None
        run_dir, resuming = astuple(resolve_run(wanted, resume, session, CLI))
    with session.during("model set-up"):
        # precision and compile "auto" on a GPU: timed on throw-away jobs before the run's own is made
        tuned = tune(cfg, session, opened.precision, lambda: _probe(cfg, spec, data, session), probe_on_cpu)
        opened = dataclasses.replace(opened, cfg=tuned.cfg, precision=tuned.precision)
        cfg, precision = opened.cfg, opened.precision
        weights, notes = weights_for(pre, spec) if pre is not None else (None, [])
        job, work = recipe_job(cfg, spec, data, session, precision, weights)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, model_fingerprint(spec.name, spec.config),
                        is_writer=session.is_writer, watch=session.watch())

    def write_config(cfg: Config) -> None:
        (run_dir / "config.toml").write_text(cfg.to_toml())
        keep_tokenizer(run_dir, data.tokenizer)  # what evaluate, generate, export and a resume read

    ranks_here = session.env.local_world_size if session.env is not None else 1
    prep = Prepared(job, work, data.train, run_dir, ckpt, resuming,
                    restore=lambda ckpt, job: restore_job(ckpt, job, cfg, session.world),
                    write_config=write_config, resume_how=resume_command(session, run_dir),
                    loader_options={"num_workers": cfg.data.num_workers, "cores": max(1, usable_cores() // ranks_here)},
                    start_lines=_start_lines(session, tuned, spec, work, data, cfg.parallel.fsdp_cpu_offload, pre,
                                             notes),
                    leave=lambda job: after_training(cfg, spec, job.model, ckpt, session, run_dir, console),
                    out_of_memory=lambda e: out_of_memory_report(e, cfg, session, precision))
    outcome = run_prepared(opened, prep)
    return RunResult(run_dir, outcome.summary, outcome.records, job.model, job.optimizer)


def _probe(cfg: Config, spec: models.ModelSpec, data: Data, session: Session) -> tuple[MakeJob, dict]:
    """Jobs of the recipe's model for `autotune.tune`, each a fresh model at the run's seed."""
    device = session.device.torch_device

    def make(trial: Config, precision: Precision, batches) -> Job:
        materialize = functools.partial(models.materialize, device=device, dtype=precision.param_dtype,
                                        seed=cfg.run.seed)
        task = Task(models.loss_for(spec), batches=batches, micro_batch=trial.train.batch_size)
        return build_job(models.build_meta(spec), trial, session, precision, task, materialize)
    return probe_jobs(data.train, session, cfg, {"name": spec.name, **dataclasses.asdict(spec.config)}, make)


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


def _start_lines(session: Session, tuned: Tuned, spec, work: Workload, data: Data, offload: bool,
                 pre: Pretrained | None = None, notes: list[str] = ()) -> list[str]:
    lines = [f"Precision: {tuned.precision.describe()}", f"Compile: {tuned.compile_note}",
             f"Model: {spec.name}: {models.describe(spec)}; {work.n_params / 1e6:.2f}M parameters"]
    if pre is not None:
        lines += [f"Weights: {pre.describe()}", *notes]
    if session.world > 1:
        lines.append(f"Parallel: {session.dims.describe()} over {session.world} processes")
    if offload:
        here = " (on the CPU that saves nothing: its memory is the host's)" if session.device.type == "cpu" else ""
        lines.append(f"FSDP CPU offload: weights, gradients and optimizer state in host memory; the update runs "
                     f"there{here}")
    lines.append(f"Data: {data.description}")
    if data.val is None:
        lines.append(f"Evaluation: none, the data has no validation part ({data.no_val})")
    return lines
