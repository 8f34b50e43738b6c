"""`gpudl.fit`: train any nn.Module on the best device, with the same loop and metrics as the recipes.

>>> import torch, torch.nn.functional as F
>>> x, y = torch.randn(256, 8), torch.randint(0, 2, (256,))
>>> result = fit(torch.nn.Linear(8, 2), (x, y), loss=F.cross_entropy, max_steps=5, batch_size=32,
...              device="cpu", progress=False, quiet=True)
>>> result.metrics.steps
5
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader

from ..config import CheckpointConfig, Config, LogConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from ..config.settings import from_dict
from ..data import DeviceLoader
from ..data.datasets import DatasetBatches, as_batch_source
from ..data.loader import Batch, map_tensors, tensors_in
from ..errors import UserError
from ..device.peak import measured_peak_flops, peak_key
from ..distributed.parallelize import compile_wanted
from ..memory.auto import plan_module, state_needs_sharding
from ..memory.limit import enforce_memory_limit
from .. import models
from ..observe.flops import count_training_flops, meta_batch
from .job import Task, build_job
from .loop import TrainState
from .micro import micro_batches, rows
from .precision import make_precision
from .run_dir import prepare_run_dir
from .runner import Execution, Workload, execute
from .session import Session, plan_parallel, start_session

# The sections of a run's config that fit's keywords fill in.
SECTIONS = {"train": TrainConfig, "optim": OptimConfig, "run": RunConfig, "log": LogConfig}


@dataclass
class Metrics:
    """Headline figures of a `fit`: rates average the log windows after the first (warm-up)."""

    steps: int
    final_loss: float
    samples_per_s: float
    step_s: float
    mfu: float
    peak_mem_gb: float
    mfu_note: str | None = None  # why MFU is 0: the FLOPs could not be counted


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


def _takes_labels(model: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward whose signature Python cannot read
        return False


def _prediction(out: Any) -> Any:
    """What a user's `loss` gets from the model's output: its logits, else its first element, else itself."""
    if isinstance(out, Mapping):  # a dict, or a Hugging Face ModelOutput
        return out["logits"] if "logits" in out else next(iter(out.values()))
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def _own_loss(out: Any) -> Any:
    """With loss=None: the model's output itself, or its `loss` field (a dict, a dataclass, a ModelOutput)."""
    found = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)
    if found is None:
        raise UserError(f"with loss=None the model must compute its loss, but it returned a {type(out).__name__} "
                        f"without one: give the model its targets (a dict batch with 'labels', as Hugging Face "
                        f"models take them) or pass loss=")
    return found


def _scalar(loss: Any) -> torch.Tensor:
    """The loss, if it is one number that backward can follow to the weights."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        if not loss.requires_grad:
            raise UserError("the loss does not depend on any trainable parameter (it has no gradient): compute it "
                            "from the model's output, without .detach()")
        return loss
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
        f"a {type(loss).__name__} ({repr(loss)[:40]})"
    raise UserError(f"the loss must be a scalar tensor, got {got}: return one value as a tensor (F.cross_entropy(...), "
                    f"loss.mean()), not loss.item()")


def _with_target(model: nn.Module, batch: Batch, loss: Callable) -> Any:
    if isinstance(batch, dict):
        if "labels" not in batch:
            raise UserError(f"with loss= given, a dict batch holds the target under 'labels', but this one has "
                            f"{list(batch)}: name the target 'labels', or pass loss=None if the model computes "
                            f"its loss")
        return loss(_prediction(model(**{k: v for k, v in batch.items() if k != "labels"})), batch["labels"])
    if len(batch) < 2:
        raise UserError(f"with loss= given, a batch is (inputs..., target), but this one holds {len(batch)} "
                        f"element: add the target, or pass loss=None if the model computes its loss")
    return loss(_prediction(model(*batch[:-1])), batch[-1])


def _loss_fn(loss: Callable | None, model: nn.Module) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """How a batch becomes a loss; the result is checked to be a scalar with a gradient, every step."""
    if loss is not None:
        return lambda m, batch: _scalar(_with_target(m, batch, loss))
    labels_by_name = _takes_labels(model)

    def own(m: nn.Module, batch: Batch) -> torch.Tensor:
        if isinstance(batch, dict):
            return _scalar(_own_loss(m(**batch)))
        if labels_by_name and len(batch) > 1:  # (inputs..., labels) for a model that takes labels=
            return _scalar(_own_loss(m(*batch[:-1], labels=batch[-1])))
        return _scalar(_own_loss(m(*batch)))
    return own


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


def _new_run_dir(run_dir: str | Path | None, session: Session) -> Path | None:
    """`run_dir`, refused as the CLI refuses it when it already holds a run (fit starts runs, never resumes)."""
    if run_dir is None:
        return None
    path = Path(run_dir)
    if session.agree(path.is_dir() and any(path.iterdir())):
        raise UserError(f"run folder {path} already holds a run: pass another run_dir=, or delete the folder to "
                        f"start again")
    return path


def _check_trainable(model: nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"the model ({type(model).__name__}) has no trainable parameters (none, or all with "
                        f"requires_grad=False): unfreeze some with p.requires_grad_(True)")


def _same_weights_everywhere(model: nn.Module, session) -> None:
    """Rank 0's weights on every rank: sharding (FSDP) splits what each rank holds, so it must agree."""
    if session.world > 1:
        for t in model.state_dict().values():
            torch.distributed.broadcast(t, src=0)


def _config(parallel: ParallelConfig | None, **sections: dict[str, Any]) -> Config:
    """fit's keywords as a run's config, each section checked as a config file's is (settings.from_dict)."""
    built = {name: _checked(SECTIONS[name], values) for name, values in sections.items()}
    return Config(**built, parallel=parallel or ParallelConfig(), checkpoint=CheckpointConfig(every=0, export=False))


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


def fit(model: nn.Module, train_data, loss: Callable | None = None, *, max_steps: int = 1000,
        batch_size: int = 32, lr: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 0,
        grad_accum: int = 1, grad_clip: float = 1.0, device: str = "auto", precision: str = "auto",
        compile: bool | str = "auto", activation_checkpointing: bool | str = False, log_every: int = 10,
        seed: int = 0, run_dir: str | Path | None = None, progress: bool = True, quiet: bool = False,
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
    Metrics go to the console, and to `run_dir` (JSONL, CSV, plot) when given: a new folder, or
    an empty one. Started by torchrun (or `gpudl train --nproc-per-node`), every process runs
    `fit` on the same model and data: each trains on its own share of every batch (`batch_size`
    per process; an iterable's batches are dealt out in turn), with DDP by default or as
    `parallel` says. `memory_limit` ("12GiB" or bytes, per device) is enforced; a step that runs
    out of memory, under it or the device's own, is run again with half the micro-batch.
    `activation_checkpointing`: True (or "full") recomputes each block's activations in backward,
    "selective" all but its matmuls', attention's and convolutions' outputs.
    `plan="auto"` traces the model on fake tensors first (nothing allocated) and trains with the
    largest micro-batch that fits, with activation checkpointing only if nothing fits without;
    the samples per step are kept (one process or DDP).
    """
    limit_text = f"{memory_limit}B" if isinstance(memory_limit, int) and not isinstance(memory_limit, bool) \
        else memory_limit or ""
    cfg = _config(parallel, train={"max_steps": max_steps, "batch_size": batch_size, "grad_accum": grad_accum,
                                   "precision": precision, "compile": compile, "grad_clip": grad_clip,
                                   "activation_checkpointing": activation_checkpointing, "log_every": log_every,
                                   "eval_every": 0, "memory_limit": limit_text, "plan": plan},
                  optim={"lr": lr, "weight_decay": weight_decay, "warmup_steps": warmup_steps, "min_lr_ratio": 0.1},
                  run={"device": device, "seed": seed}, log={"progress": progress})
    _check_trainable(model)
    console = Console(quiet=quiet)
    session = start_session(cfg.run, console, offload=cfg.parallel.fsdp_cpu_offload)
    console = console if session.is_writer else Console(quiet=True)
    out_dir = _new_run_dir(run_dir, session)
    prec = make_precision(cfg.train.precision, session.device)
    n_params = sum(p.numel() for p in model.parameters())
    plan_parallel(session, cfg.parallel, state_needs_sharding(n_params, prec.param_dtype.itemsize, session, cfg))
    measured_peak_flops(session.device, peak_key(prec.name))  # for MFU; measured now, not under a limit
    compiled = compile_wanted(cfg.train.compile, session.device.type)
    with enforce_memory_limit(session.device, cfg.train.memory_limit, compiled) as limit:
        return _fit(model, train_data, loss, cfg, session, prec, out_dir, console, limit)


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


def _fit(model, train_data, loss, cfg: Config, session: Session, prec, out_dir, console, limit) -> FitResult:
    torch.manual_seed(cfg.run.seed)
    source, first, cfg, drawing = _data(train_data, cfg, session, console)
    loss_fn = _loss_fn(loss, model)
    if cfg.train.plan == "auto":
        cfg, drawing = _planned(model, loss_fn, first, cfg, session, console, drawing)
    # With CPU offload the weights stay on the host: FSDP moves each block to the device in turn, to shard it
    model = model.to(prec.param_dtype) if cfg.parallel.fsdp_cpu_offload else \
        model.to(session.device.torch_device, prec.param_dtype)
    if limit is not None:
        limit.hold(model)  # made before the limit: it counts all the same
    # counted on a meta copy where the weights stay on the host (CPU offload) and the batch is on the device
    work = _workload(models.meta_copy(model), loss_fn, meta_batch(first), rows(first), console) \
        if cfg.parallel.fsdp_cpu_offload else _workload(model, loss_fn, first, rows(first), console)
    model.zero_grad(set_to_none=True)  # the first step's gradients are its own batch's alone
    _same_weights_everywhere(model, session)
    loader = DeviceLoader(source, session.device.torch_device)
    job = build_job(model, cfg, session, prec, Task(loss_fn, loader, **drawing))
    if out_dir is not None:
        prepare_run_dir(out_dir, session)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=prec.name))
    outcome = execute(Execution(session, job, cfg, TrainState(), loader, work, out_dir), console)
    s = outcome.summary
    metrics = Metrics(s["steps"], s["final_loss"], s["samples_per_s"], s["step_s"], s["mfu"], s["peak_mem_gb"],
                      work.mfu_note)
    return FitResult(job.model, metrics, outcome.records, s)
