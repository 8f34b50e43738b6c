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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader

from .. import models
from ..checkpoint import Checkpointer
from ..config import CheckpointConfig, Config, LogConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from ..config.settings import from_dict
from ..data.datasets import DatasetBatches, IterableBatches, as_batch_source, as_eval_batches
from ..data.loader import Batch, map_tensors, tensors_in
from ..distributed.session import Session, plan_parallel
from ..errors import UserError
from ..memory.auto import plan_module, state_needs_sharding
from ..observe.flops import count_training_flops, meta_batch
from ..training.job import Task, build_job
from ..training.loop import Job
from ..training.micro import micro_batches, rows
from ..training.precision import Precision
from .autotune import MakeJob, tune
from .fit_loss import eval_fn_for, loss_fn_for
from .fit_onnx import serving_input
from .fit_resume import check_same_run, fit_table, fit_toml, leave_model, module_fingerprint, restore, resume_call
from .run_dir import FIT, RunFolder, resolve_run
from .runner import Workload
from .stages import Opened, Prepared, open_run, probe_jobs, run_prepared

# The sections of a run's config that fit's keywords fill in.
SECTIONS = {"train": TrainConfig, "optim": OptimConfig, "run": RunConfig, "log": LogConfig}


@dataclass
class Metrics:
    """Headline figures of a `fit`: rates average the log windows after the first (warm-up); MFU is a
    fraction (0.42 is 42%) of the device's peak FLOP/s at the run's precision."""

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
    """What `fit` returns: the trained model, its headline `Metrics`, every metric record (dicts with
    "kind" "train" or "eval", "step", "loss", throughput, ...) and the summary the console shows."""

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
    """Train `model` on `train_data` on the best device here, and return it with its metrics.

    The step is the recipes' own (AdamW, warm-up then cosine to a tenth of `lr`, clipping, a guard
    that skips non-finite steps); docs/python.md shows it with validation, checkpoints, resume,
    several processes and a Hugging Face model.

    Args:
        model: any nn.Module; it is trained in place and returned in `FitResult.model`.
        train_data: a map-style Dataset, tensors (a tuple (inputs..., targets) or a dict of columns),
            or an iterable of batches: a DataLoader (its own batch size wins), a list, a generator
            (read once: it must hold max_steps * grad_accum batches). A batch is a tuple
            (inputs..., target) or a dict whose "labels" is the target; tensors may be nested.
        loss: loss(prediction, target) -> scalar tensor. The prediction is the model's output, or
            its `logits` (a Hugging Face ModelOutput, a dict) or first element. None: the model
            computes its own loss (a tensor, or its output's `loss`); a dict batch goes in as
            keyword arguments, a tuple by position, its last element as `labels=` where the
            model's forward takes that argument (Hugging Face models do).
        val_data: data of the same kinds (not a generator), evaluated every `eval_every` steps in
            eval mode without gradients: its mean loss, as "eval" records and `val_loss`.
        metrics: metrics(prediction, target) -> dict of batch means on `val_data`, e.g.
            {"accuracy": (p.argmax(-1) == t).float().mean()}; reported as `val_<name>`.
        max_steps: optimizer steps to train.
        batch_size: samples per micro-batch and process (a dataset's or tensors'; a DataLoader's own
            batch size is used as it is).
        lr: the peak learning rate.
        weight_decay: AdamW's, on matrices only (not on norms and biases).
        warmup_steps: steps of linear warm-up before the cosine decay.
        grad_accum: micro-batches accumulated into each step.
        grad_clip: the global gradient norm is clipped to this (0: no clipping).
        device: "auto" (the best accelerator, else the CPU), "cpu", "cuda", "cuda:1", "mps", "xpu".
        precision: "auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-true" or "fp8"; "auto" on a
            GPU times fp32 against bf16-mixed on a copy of the model and takes the faster.
        compile: True, False, "auto" (timed on a GPU, as precision is) or "reduce-overhead" (CUDA
            graphs).
        activation_checkpointing: True or "full" recomputes each block's activations in backward;
            "selective" all but its matmuls', attention's and convolutions' outputs.
        log_every: steps between metric records (and progress lines).
        eval_every: steps between evaluations of `val_data` (0: only at the end).
        checkpoint_every: steps between checkpoints into `run_dir` (0: at the end only; a SIGINT or
            SIGTERM also saves one, says how to resume and returns with summary["stopped_by"]).
        seed: the seed of the initial RNG state, the data order and dropout.
        run_dir: a new or empty folder for metrics (JSONL, CSV, plot), config.toml and checkpoints;
            None: nothing is written.
        resume: a run_dir to continue from its newest checkpoint (weights, optimizer, schedule, loss
            scale, RNG, data position), with the same model, data, batch_size, grad_accum, seed and
            processes (what differs is named); max_steps may grow, lr may change. A DataLoader is
            read again from its start, so its shuffling needs its own generator. "auto": continue
            `run_dir` if it holds a checkpoint, else start it (a script a preemptible job reruns).
        progress: a live progress bar on the console.
        quiet: print nothing.
        parallel: the layout under torchrun (`ParallelConfig`: DDP by default; FSDP2 with
            dp_shard, its CPU offload, and timeout_s, how long a collective may wait). Each process
            trains on its share of every batch (`batch_size` per process).
        memory_limit: "12GiB" or bytes, per device, enforced; a step that runs out of memory, under
            it or the device's own, is run again with half the micro-batch.
        plan: "auto" traces the model on fake tensors (nothing allocated) and trains with the
            largest micro-batch that fits, checkpointing only if nothing fits without; the samples
            per step are kept (one process or DDP). "off": as given.

    Returns:
        FitResult: the trained model, its `Metrics`, every metric record and the run's summary.

    Raises:
        UserError: an argument, the data or a resume that cannot work, in one line with the fix.
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
    n_params = sum(p.numel() for p in model.parameters())

    def shard(cfg: Config, session: Session, prec: Precision) -> bool:
        return state_needs_sharding(n_params, prec.param_dtype.itemsize, session, cfg)
    with open_run(cfg, Console(quiet=quiet), shard=shard, model=model) as opened:
        folder = resolve_run(Path(run_dir) if run_dir is not None else None, resume, opened.session, FIT)
        return _fit(user, opened, folder)


def _limit_text(memory_limit: str | int | None) -> str:
    """fit's memory_limit as train.memory_limit takes it: bytes as "<n>B", a size as it is, none as ""."""
    if isinstance(memory_limit, int) and not isinstance(memory_limit, bool):
        return f"{memory_limit}B"
    return memory_limit or ""


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
    if resume not in (None, "auto") and run_dir is not None and Path(run_dir).resolve() != Path(resume).resolve():
        raise UserError(f"resume={str(resume)!r} and run_dir={str(run_dir)!r} name two folders: resume names the "
                        f"run it continues, and writes there; pass resume= alone")
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


def _fit(user: _UserParts, opened: Opened, run: RunFolder) -> FitResult:
    cfg, session, console = opened.cfg, opened.session, opened.console
    torch.manual_seed(cfg.run.seed)
    source, first, cfg, drawing = _data(user.train_data, cfg, session, console)
    # before planning, which may cut a step otherwise: what a step trains on is what a resume must repeat
    table = fit_table(cfg, user.model, session, _data_kind(user.train_data, source))
    if run.resuming:
        _check_replayable(source)
        check_same_run(run.folder, table, session)
    loss_fn = loss_fn_for(user.loss, user.model)
    serving = serving_input(first, user.loss)  # its first rows, kept to export the trained module at the end
    if cfg.train.plan == "auto":
        cfg, drawing = _planned(user.model, loss_fn, first, cfg, session, console, drawing)
    # precision and compile "auto" on a GPU: timed on copies of the model before it is placed
    tuned = tune(cfg, session, opened.precision, lambda: _probe(user, loss_fn, source, cfg, session, drawing))
    cfg, prec = tuned.cfg, tuned.precision
    model = _placed(user.model, cfg, session, prec, opened.limit)
    # counted on a meta copy where the weights stay on the host (CPU offload) and the batch is on the device
    work = _workload(models.meta_copy(model), loss_fn, meta_batch(first), rows(first), console) \
        if cfg.parallel.fsdp_cpu_offload else _workload(model, loss_fn, first, rows(first), console)
    model.zero_grad(set_to_none=True)  # the first step's gradients are its own batch's alone
    _same_weights_everywhere(model, session)
    task = Task(loss_fn, **drawing, **_evaluation(user, table["batch_size"], session.device.torch_device))
    job = build_job(model, cfg, session, prec, task)
    ckpt = Checkpointer(run.folder / "checkpoints", cfg.checkpoint.keep, user.fingerprint,
                        is_writer=session.is_writer, watch=session.watch()) if run.folder is not None else None
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=prec.name))
    prep = Prepared(job, work, source, run.folder, ckpt, run.resuming,
                    restore=lambda ckpt, job: restore(ckpt, job, cfg, session),
                    write_config=lambda cfg: (run.folder / "config.toml").write_text(fit_toml(cfg, table)),
                    resume_how=resume_call(run.folder),
                    leave=(lambda job: leave_model(user.model, job.model, run.folder, session, console,
                                                   serving))
                    if run.folder is not None else None,
                    start_lines=[f"Precision: {prec.describe()}", f"Compile: {tuned.compile_note}"]
                    if tuned.probed else [])
    outcome = run_prepared(dataclasses.replace(opened, cfg=cfg, precision=prec), prep)
    s = outcome.summary
    metrics = Metrics(s["steps"], s["final_loss"], s["samples_per_s"], s["step_s"], s["mfu"], s["peak_mem_gb"],
                      work.mfu_note, s.get("mfu_datasheet"))
    return FitResult(job.model, metrics, outcome.records, s)


def _probe(user: _UserParts, loss_fn, source, cfg: Config, session: Session, drawing: dict) -> tuple[MakeJob, dict]:
    """Jobs of a copy of the user's module for `autotune.tune`: the module itself is untouched (its
    weights are the run's)."""
    def make(trial: Config, precision: Precision, batches) -> Job:
        model = _placed(copy.deepcopy(user.model), trial, session, precision, None)
        model.zero_grad(set_to_none=True)
        return build_job(model, trial, session, precision, Task(loss_fn, batches=batches, **drawing))
    return probe_jobs(source, session, cfg, user.fingerprint, make)


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
