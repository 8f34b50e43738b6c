"""`gpudl.fit`: train any nn.Module on the best device, with the same loop and metrics as the recipes.

>>> import torch, torch.nn.functional as F
>>> x, y = torch.randn(256, 8), torch.randint(0, 2, (256,))
>>> result = fit(torch.nn.Linear(8, 2), (x, y), loss=F.cross_entropy, max_steps=5, batch_size=32,
...              device="cpu", progress=False, quiet=True)
>>> result.metrics.steps
5
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader

from ..config import CheckpointConfig, Config, LogConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from ..config.settings import from_dict
from ..data import DeviceLoader, first_batches
from ..data.datasets import DatasetBatches, IterableBatches, as_batch_source, as_eval_batches
from ..data.loader import Batch, map_tensors, tensors_in
from ..errors import UserError
from ..device.peak import measured_peak_flops, peak_key
from ..distributed.parallelize import compile_wanted
from ..memory.auto import plan_module, state_needs_sharding
from ..memory.limit import enforce_memory_limit
from .. import models
from ..observe.flops import count_training_flops, meta_batch
from .autotune import MakeJob, job_identity, tune
from ..training.job import Task, build_job
from ..training.loop import Job, TrainState
from ..training.micro import micro_batches, rows
from .fit_loss import eval_fn_for, loss_fn_for
from .fit_resume import (FitRun, check_same_run, checkpointer, fit_table, module_fingerprint, resolve_fit_run,
                         restore, say_stopped, write_config)
from ..training.precision import make_precision
from .runner import Execution, Workload, background_saves, execute
from ..distributed.session import Session, plan_parallel, start_session

# The sections of a run's config that fit's keywords fill in.
SECTIONS = {"train": TrainConfig, "optim": OptimConfig, "run": RunConfig, "log": LogConfig}


@dataclass
class Metrics:
    """Headline figures of a `fit`: rates average the log windows after the first (warm-up)."""

    steps: int
    final_loss: float
    samples_per_s: float
    step_s: float
    mfu: float | None            # against the measured peak; None: the FLOPs could not be counted
    peak_mem_gb: float
    mfu_note: str | None = None  # why MFU is None: the FLOPs could not be counted
    mfu_datasheet: float | None = None  # against the datasheet peak; None where unknown (every CPU)


@dataclass
class FitResult:
    model: nn.Module
    metrics: Metrics
    records: list[dict]
    summary: dict


def _checked(cls: type, values: dict[str, Any]) -> Any:
    """`cls` built from fit's arguments with the same typed checks as a config file's (settings.from_dict)."""
    try:
        return from_dict(cls, values, "")
    except UserError as e:  # settings.py words the fix for the command line; here it is an argument
        raise UserError(str(e).replace("set --set ", "pass ")) from None


def _count_flops(model: nn.Module, loss_fn, batch: Batch) -> tuple[int, str | None]:
    """(FLOPs of one training step on `batch`, why MFU is not reported when they cannot be counted)."""
    try:
        flops = count_training_flops(model, batch, loss_fn)
    except UserError:  # bad input (the loss, the batch): the user must hear of it now
        raise
    except Exception as e:  # an op the counter cannot follow: train anyway, and say why MFU is missing
        return 0, f"the FLOP counter failed on this model ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    if flops == 0:
        return 0, "the FLOP counter found no matrix product, convolution or attention in the model"
    return flops, None


def _samples_per_batch(data: Any, source: Any, first: Batch, batch_size: int, console: Console) -> int:
    """`batch_size` for a dataset; for an iterable of batches what they hold (a DataLoader's own batch size)."""
    if isinstance(source, DatasetBatches):
        console.print(f"Data: {len(source.dataset):,} samples, {batch_size} per batch")
        return batch_size
    if isinstance(data, DataLoader) and data.batch_size:
        n, what = data.batch_size, f"a DataLoader with batch size {data.batch_size}"
    else:
        n = next((t.shape[0] for t in tensors_in(first) if t.dim()), 1)
        what = f"a {type(data).__name__} of batches of {n} samples"
    console.print(f"Data: {what}" + (f"; fit's batch_size={batch_size} is not used" if n != batch_size else ""),
                  markup=False)
    return n


def _check_trainable(model: nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"the model ({type(model).__name__}) has no trainable parameters (none, or all with "
                        f"requires_grad=False): unfreeze some with p.requires_grad_(True)")


def _same_weights_everywhere(model: nn.Module, session) -> None:
    """Rank 0's weights on every rank: sharding (FSDP) splits what each rank holds, so it must agree."""
    if session.world > 1:
        for t in model.state_dict().values():
            torch.distributed.broadcast(t, src=0)


def _config(parallel: ParallelConfig | None, checkpoint_every: int = 0, **sections: dict[str, Any]) -> Config:
    """fit's keywords as a run's config, each section checked as a config file's is (settings.from_dict)."""
    built = {name: _checked(SECTIONS[name], values) for name, values in sections.items()}
    if type(checkpoint_every) is not int or checkpoint_every < 0:  # checkpoint.every's check, in fit's words
        raise UserError(f"checkpoint_every must be an int >= 0 (0: at the end only), got {checkpoint_every!r}: pass "
                        f"checkpoint_every=<steps between checkpoints>")
    saving = CheckpointConfig(every=checkpoint_every, export=False)
    return Config(**built, parallel=parallel or ParallelConfig(), checkpoint=saving)


def _workload(model: nn.Module, loss_fn, first: Batch, batch_size: int, console: Console) -> Workload:
    flops, mfu_note = _count_flops(model, loss_fn, first)
    if mfu_note:
        console.print(f"MFU not reported: {mfu_note}", markup=False)
    return Workload(type(model).__name__, "samples", 1, flops // batch_size,
                    n_params=sum(p.numel() for p in model.parameters()), mfu_note=mfu_note)


def _data(train_data: Any, cfg: Config, session: Session, console: Console):
    """(batch source, a first micro-batch on the device, the config with the batch size the data has,
    the Task fields that say how a step draws its data). A dataset gives each step's rows in one
    batch, cut into micro-batches by the loop; an iterable's batches are drawn `grad_accum` a step."""
    train = cfg.train
    source = as_batch_source(train_data, train.batch_size * train.grad_accum, cfg.run.seed, *session.dp)
    whole = isinstance(source, DatasetBatches)
    first = source.batch(0)  # the loader asks for it again: an iterable's source keeps the batch it read last
    first = micro_batches([first], train.batch_size)[0] if whole else first
    n = _samples_per_batch(train_data, source, first, train.batch_size, console)
    on_device = map_tensors(lambda t: t.to(session.device.torch_device), first)
    drawing = {"draws": 1, "micro_batch": n} if whole else {"draws": train.grad_accum, "micro_batch": 0}
    return source, on_device, dataclasses.replace(cfg, train=dataclasses.replace(train, batch_size=n)), drawing


def fit(model: nn.Module, train_data, loss: Callable | None = None, *, val_data=None,
        metrics: Callable | None = None, max_steps: int = 1000, batch_size: int = 32, lr: float = 1e-3,
        weight_decay: float = 0.0, warmup_steps: int = 0, grad_accum: int = 1, grad_clip: float = 1.0,
        device: str = "auto", precision: str = "auto", compile: bool | str = "auto",
        activation_checkpointing: bool | str = False, log_every: int = 10, eval_every: int = 0,
        checkpoint_every: int = 0, seed: int = 0, run_dir: str | Path | None = None,
        resume: str | Path | None = None, progress: bool = True, quiet: bool = False,
        parallel: ParallelConfig | None = None, memory_limit: str | int | None = None,
        plan: str = "off") -> FitResult:
    """Train `model` on `train_data` and return it with its metrics.

    `train_data`: a map-style Dataset, tensors (a tuple (inputs..., targets), or a dict of
    columns), or any iterable of batches: a DataLoader (used as it is: its batch size wins over
    `batch_size`), a list, a generator (read once: it must hold `max_steps * grad_accum` batches).
    A batch is a tuple (inputs..., target) or a dict; tensors in them may be nested.
    `loss(prediction, target)`: the prediction is the model's output, or its `logits` (a Hugging
    Face ModelOutput, a dict) or first element; the target is a tuple's last element, a dict
    batch's "labels" (the other keys are the model's keyword arguments). With `loss=None` the
    model computes its own loss, returned as a tensor or as the `loss` of its output: a dict batch
    is passed as keyword arguments, a tuple by position, except that its last element goes to
    the model's `labels` argument when its forward has one (Hugging Face models do).
    `val_data` (the same kinds, but not a generator: it is read at every evaluation; a dataset in
    batches of `batch_size`) is evaluated every `eval_every` steps (0: only at the end), in eval
    mode and without gradients: the mean loss over its samples, and what `metrics(prediction,
    target)` returns (a dict of batch means, e.g. {"accuracy": (p.argmax(-1) == t).float().mean()}),
    as "eval" records and as `val_<name>` in the summary. Every process evaluates all of it.
    Metrics go to the console, and to `run_dir` (JSONL, CSV, plot, config.toml) when given: a new
    folder, or an empty one, checkpointed at the end, every `checkpoint_every` steps (0: at the end
    only) and when SIGINT or SIGTERM stops it (it then says how to resume, and returns with
    `summary["stopped_by"]`). `resume=RUN_DIR` continues that run from its newest checkpoint (weights,
    optimizer, schedule, loss scale, RNG, data position: on the CPU bit for bit as if never stopped)
    with the same model, data, batch_size, grad_accum, seed and processes (what differs is named);
    max_steps may grow, lr may change. A DataLoader is read again from its start to skip what the
    run consumed, so its shuffling needs a generator of its own (`generator=torch.Generator()
    .manual_seed(0)`); a generator cannot be read again and is refused. `resume="auto"` continues
    `run_dir` when it holds a checkpoint and starts it otherwise (a script a preemptible job reruns).
    Started by torchrun (or `gpudl train --nproc-per-node`), every process runs `fit` on the same model and data: each
    trains on its own share of every batch (`batch_size` per process; an iterable's batches are dealt out in turn),
    with DDP by default or as `parallel` says. `memory_limit` ("12GiB" or bytes, per device) is enforced; a step that
    runs out of memory, under it or the device's own, is run again with half the micro-batch.
    `activation_checkpointing`: True (or "full") recomputes each block's activations in backward, "selective" all but
    its matmuls', attention's and convolutions' outputs. `plan="auto"` traces the model on fake tensors (nothing
    allocated) and trains with the largest micro-batch that fits, checkpointing only if nothing fits without; the
    samples per step are kept (one process or DDP). `precision`, `compile` "auto": on a GPU copies of the model are
    timed, the fastest taken (fp32 or bf16-mixed; eager, compiled or CUDA graphs, `compile="reduce-overhead"`).
    """
    cfg = _config(parallel, checkpoint_every,
                  train={"max_steps": max_steps, "batch_size": batch_size, "grad_accum": grad_accum,
                         "precision": precision, "compile": compile, "grad_clip": grad_clip,
                         "activation_checkpointing": activation_checkpointing, "log_every": log_every,
                         "eval_every": eval_every, "memory_limit": _limit_text(memory_limit), "plan": plan},
                  optim={"lr": lr, "weight_decay": weight_decay, "warmup_steps": warmup_steps, "min_lr_ratio": 0.1},
                  run={"device": device, "seed": seed}, log={"progress": progress})
    _check_pairs(checkpoint_every, run_dir, resume, val_data, metrics)
    _check_trainable(model)
    user = _UserParts(model, train_data, loss, val_data, metrics, module_fingerprint(model))  # before it moves
    console = Console(quiet=quiet)
    session = start_session(cfg.run, console, offload=cfg.parallel.fsdp_cpu_offload)
    console = console if session.is_writer else Console(quiet=True)
    return _start(user, cfg, session, resolve_fit_run(run_dir, resume, session), console)


def _limit_text(memory_limit: str | int | None) -> str:
    """fit's memory_limit as train.memory_limit takes it: bytes as "<n>B", a size as it is, none as ""."""
    if isinstance(memory_limit, int) and not isinstance(memory_limit, bool):
        return f"{memory_limit}B"
    return memory_limit or ""


def _start(user: _UserParts, cfg: Config, session: Session, run: FitRun, console) -> FitResult:
    """The layout, the peak for MFU and the memory limit, then the run."""
    model = user.model
    prec = make_precision(cfg.train.precision, session.device)
    n_params = sum(p.numel() for p in model.parameters())
    plan_parallel(session, cfg.parallel, state_needs_sharding(n_params, prec.param_dtype.itemsize, session, cfg))
    measured_peak_flops(session.device, peak_key(prec.name))  # for MFU; measured now, not under a limit
    compiled = compile_wanted(cfg.train.compile, session.device.type)
    with enforce_memory_limit(session.device, cfg.train.memory_limit, compiled) as limit:
        return _fit(user, cfg, session, prec, run, console, limit)


@dataclass
class _UserParts:
    """What the user passed that is not a setting."""

    model: nn.Module
    train_data: Any
    loss: Callable | None
    val_data: Any
    metrics: Callable | None
    fingerprint: dict


def _check_pairs(checkpoint_every: int, run_dir, resume, val_data, metrics) -> None:
    """Keywords that need another one."""
    if checkpoint_every and run_dir is None and resume is None:
        raise UserError(f"checkpoint_every={checkpoint_every} saves checkpoints into the run folder: pass run_dir= too")
    if metrics is not None and val_data is None:
        raise UserError("metrics= are computed on the validation data: pass val_data= too")


def _evaluation(user: _UserParts, batch_size: int, device: torch.device) -> dict:
    """The Task's evaluation fields for `val_data` (none without it)."""
    if user.val_data is None:
        return {}
    passes = as_eval_batches(user.val_data, batch_size)

    def batches():
        # Evaluation must not move the RNG training draws from (a DataLoader draws its seeds from it):
        # a run's steps are then the same whatever eval_every is, and a resumed run's too.
        with torch.random.fork_rng(devices=[]):
            for batch in passes():
                yield map_tensors(lambda t: t.to(device), batch)
    return {"eval_fn": eval_fn_for(user.loss, user.model, user.metrics), "eval_batches": batches}


def _planned(model, loss_fn, first, cfg: Config, session: Session, console, drawing: dict) -> tuple[Config, dict]:
    """fit(plan="auto"): the micro-batch, checkpointing and CPU offload the planner chose, the samples per
    step kept. Offload makes this process FSDP over a group of one (`plan_parallel`)."""
    chosen = plan_module(model, loss_fn, first, cfg, session, console)
    micro, step_rows = chosen["micro_batch"], cfg.train.batch_size * cfg.train.grad_accum
    train = dataclasses.replace(cfg.train, batch_size=micro, grad_accum=step_rows // micro,
                                activation_checkpointing=chosen["checkpointing"])
    cfg = dataclasses.replace(cfg, train=train)
    if chosen["offload"]:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, fsdp_cpu_offload=True))
        plan_parallel(session, cfg.parallel)
    return cfg, {**drawing, "micro_batch": micro}


def _fit(user: _UserParts, cfg: Config, session: Session, prec, run: FitRun, console, limit) -> FitResult:
    torch.manual_seed(cfg.run.seed)
    source, first, cfg, drawing = _data(user.train_data, cfg, session, console)
    # before planning, which may cut a step otherwise: what a step trains on is what a resume must repeat
    table = fit_table(cfg, user.model, session, _data_kind(user.train_data, source))
    if run.resuming:
        _check_replayable(source)
        check_same_run(run.folder, table, session)
    loss_fn = loss_fn_for(user.loss, user.model)
    if cfg.train.plan == "auto":
        cfg, drawing = _planned(user.model, loss_fn, first, cfg, session, console, drawing)
    # precision and compile "auto" on a GPU: timed on copies of the model before it is placed
    tuned = tune(cfg, session, prec, lambda: _probe_job(user, loss_fn, source, cfg, session, drawing))
    if tuned.probed:
        console.print(f"Precision: {tuned.precision.describe()}\nCompile: {tuned.compile_note}", markup=False,
                      soft_wrap=True)
    cfg, prec = tuned.cfg, tuned.precision
    model = _placed(user.model, cfg, session, prec, limit)
    # counted on a meta copy where the weights stay on the host (CPU offload) and the batch is on the device
    work = _workload(models.meta_copy(model), loss_fn, meta_batch(first), rows(first), console) \
        if cfg.parallel.fsdp_cpu_offload else _workload(model, loss_fn, first, rows(first), console)
    model.zero_grad(set_to_none=True)  # the first step's gradients are its own batch's alone
    _same_weights_everywhere(model, session)
    task = Task(loss_fn, **drawing, **_evaluation(user, table["batch_size"], session.device.torch_device))
    job = build_job(model, cfg, session, prec, task)
    ckpt = checkpointer(run, user.fingerprint, cfg.checkpoint.keep, session)
    state = restore(ckpt, job, cfg, session) if run.resuming else TrainState()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=prec.name))
    write_config(run.folder, cfg, table, session)  # only now: a refused resume changes nothing
    # Reading a DataLoader again up to the resumed position draws from the RNG: the restored state must stay
    with torch.random.fork_rng(devices=[]):
        job.batches = loader = DeviceLoader(source, session.device.torch_device, start=state.batches)
    if state.step:
        console.print(f"Resuming at step {state.step} (batch {state.batches}) from {run.folder}", markup=False)
    background = background_saves(cfg, session, ckpt, job)[0] if ckpt is not None else None  # checkpoint.async
    outcome = execute(Execution(session, job, cfg, state, loader, work, run.folder, ckpt, background), console)
    s = outcome.summary
    if "stopped_by" in s:
        say_stopped(console, state, cfg, s, run)
    metrics = Metrics(s["steps"], s["final_loss"], s["samples_per_s"], s["step_s"], s["mfu"], s["peak_mem_gb"],
                      work.mfu_note, s.get("mfu_datasheet"))
    return FitResult(job.model, metrics, outcome.records, s)


def _probe_job(user: _UserParts, loss_fn, source, cfg: Config, session: Session, drawing: dict
               ) -> tuple[MakeJob, dict]:
    """What `autotune.tune` times: jobs of a copy of the user's module on the first step's data, and what
    identifies the job for its cache. The module itself is untouched (its weights are the run's)."""
    device = session.device.torch_device
    step = next(first_batches(source, 1, device))

    def make_job(trial: Config, precision) -> Job:
        model = _placed(copy.deepcopy(user.model), trial, session, precision, None)
        model.zero_grad(set_to_none=True)
        return build_job(model, trial, session, precision, Task(loss_fn, batches=itertools.repeat(step), **drawing))
    return make_job, job_identity(user.fingerprint, tensors_in(step), cfg, session)


def _placed(model: nn.Module, cfg: Config, session: Session, prec, limit) -> nn.Module:
    # With CPU offload the weights stay on the host: FSDP moves each block to the device in turn, to shard it
    model = model.to(prec.param_dtype) if cfg.parallel.fsdp_cpu_offload else \
        model.to(session.device.torch_device, prec.param_dtype)
    if limit is not None:
        limit.hold(model)  # made before the limit: it counts all the same
    return model


def _data_kind(data: Any, source: Any) -> str:
    """What kind of data a run trained on, for config.toml and a resume's check."""
    return "dataset" if isinstance(source, DatasetBatches) else type(data).__name__


def _check_replayable(source: Any) -> None:
    if isinstance(source, IterableBatches) and not source.replayable:
        raise UserError(f"cannot resume on a {type(source.batches).__name__}: it cannot be read again from its start "
                        f"to skip the batches the run consumed; pass the data as a list of batches, a Dataset, "
                        f"tensors or a DataLoader (in the run and in its resume)")
