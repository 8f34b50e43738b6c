"""`gpudl.fit`: train any nn.Module on the best device, with the same loop and metrics as the recipes.

>>> import torch, torch.nn.functional as F
>>> x, y = torch.randn(256, 8), torch.randint(0, 2, (256,))
>>> result = fit(torch.nn.Linear(8, 2), (x, y), loss=F.cross_entropy, max_steps=5, batch_size=32,
...              device="cpu", progress=False, quiet=True)
>>> result.metrics.steps
5
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from .config import LogConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from .data import DeviceLoader
from .data.datasets import as_batch_source
from .distributed.parallelize import compile_wanted, parallelize
from .metrics import count_training_flops
from .optim import make_optimizer, make_scheduler
from .execute import Execution, execute
from .precision import make_precision
from .session import plan_parallel, start_session
from .train import Job, TrainState


@dataclass
class Metrics:
    """Headline figures of a `fit`: rates average the log windows after the first (warm-up)."""

    steps: int
    final_loss: float
    samples_per_s: float
    step_s: float
    mfu: float
    peak_mem_gb: float


@dataclass
class FitResult:
    model: nn.Module
    metrics: Metrics
    records: list[dict]
    summary: dict


def _loss_fn(loss: Callable | None):
    if loss is None:  # the model returns its own loss: model(*batch)
        return lambda model, batch: model(*batch)
    return lambda model, batch: loss(model(*batch[:-1]), batch[-1])


def _count_flops(model: nn.Module, loss_fn, loader_source, device: torch.device) -> int:
    batch = tuple(t.to(device) for t in loader_source.batch(0))
    try:
        return count_training_flops(model, batch, loss_fn)
    except Exception:  # an op the counter cannot follow: report no MFU rather than fail the run
        return 0


def _same_weights_everywhere(model: nn.Module, session) -> None:
    """Rank 0's weights on every rank: sharding (FSDP) splits what each rank holds, so it must agree."""
    if session.world > 1:
        for t in model.state_dict().values():
            torch.distributed.broadcast(t, src=0)


def _place(model: nn.Module, session, prec, parallel: ParallelConfig, compile, activation_checkpointing,
           batch_size: int):
    _same_weights_everywhere(model, session)
    return parallelize(model, activation_checkpointing=activation_checkpointing,
                       compile=compile_wanted(compile, session.device.type), dims=session.dims, mesh=session.mesh,
                       precision_name=prec.name, cfg=parallel, device=session.device.torch_device,
                       batch_size=batch_size)


def fit(model: nn.Module, train_data, loss: Callable | None = None, *, max_steps: int = 1000,
        batch_size: int = 32, lr: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 0,
        grad_accum: int = 1, grad_clip: float = 1.0, device: str = "auto", precision: str = "auto",
        compile: bool | str = "auto", activation_checkpointing: bool = False, log_every: int = 10,
        seed: int = 0, run_dir: str | Path | None = None, progress: bool = True, quiet: bool = False,
        parallel: ParallelConfig | None = None) -> FitResult:
    """Train `model` on `train_data` and return it with its metrics.

    `train_data`: a map-style Dataset, a tuple of tensors (inputs..., targets), or any iterable
    of batches. `loss(output, target)`; when None, `model(*batch)` must return the loss.
    Metrics go to the console, and to `run_dir` (JSONL, CSV, plot) when given. Started by
    torchrun (or `gpudl train --nproc-per-node`), every process runs `fit` on the same model and
    data: each trains on its own share of every batch (`batch_size` per process), with DDP by
    default or as `parallel` says.
    """
    console = Console(quiet=quiet)
    session = start_session(RunConfig(device=device), console)
    console = console if session.is_writer else Console(quiet=True)
    parallel = parallel or ParallelConfig()
    plan_parallel(session, parallel, sum(p.numel() for p in model.parameters()))
    prec = make_precision(precision, session.device)
    torch.manual_seed(seed)
    source = as_batch_source(train_data, batch_size, seed, *session.dp)
    loss_fn = _loss_fn(loss)
    model = model.to(session.device.torch_device, prec.param_dtype)
    flops = _count_flops(model, loss_fn, source, session.device.torch_device) // batch_size
    placed = _place(model, session, prec, parallel, compile, activation_checkpointing, batch_size)
    optim_cfg = OptimConfig(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, min_lr_ratio=0.1)
    optimizer = make_optimizer(placed.model, optim_cfg, session.device.type)
    loader = DeviceLoader(source, session.device.torch_device)
    job = Job(model=placed.model, loss_fn=loss_fn, optimizer=optimizer, precision=prec, batches=loader,
              scheduler=make_scheduler(optimizer, optim_cfg, max_steps), grad_sync=placed.grad_sync,
              clip_norm=placed.clip_norm)
    out_dir = Path(run_dir) if run_dir is not None else None
    if out_dir is not None and session.is_writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    train_cfg = TrainConfig(max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum, precision=prec.name,
                            grad_clip=grad_clip, log_every=log_every, eval_every=0)
    ex = Execution(session=session, job=job, train=train_cfg, log=LogConfig(progress=progress), state=TrainState(),
                   loader=loader, model_name=type(model).__name__, unit="samples", units_per_sample=1,
                   flops_per_sample=flops, run_dir=out_dir)
    outcome = execute(ex, console)
    s = outcome.summary
    metrics = Metrics(s["steps"], s["final_loss"], s["samples_per_s"], s["step_s"], s["mfu"], s["peak_mem_gb"])
    return FitResult(placed.model, metrics, outcome.records, s)
