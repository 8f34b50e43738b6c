"""Assembling a training job: the one way a model, its data and the settings become what the loop runs.

Recipes (`gpudl.train`), `gpudl.fit` and `gpudl bench` all call `build_job`, as the memory planner
and the server will: one attention kernel choice, one `parallelize` order, one optimizer and
schedule, so that whatever measures or plans a job measures the job that trains.

>>> import torch
>>> from gpudl.config import Config
>>> from gpudl.device import cpu_info
>>> from gpudl.training.precision import make_precision
>>> from gpudl.distributed.session import Session
>>> net = torch.nn.Linear(4, 2)
>>> job = build_job(net, Config(), Session(cpu_info()), make_precision("fp32", cpu_info()),
...                 Task(loss_fn=lambda model, batch: model(batch[0]).square().mean()))
>>> type(job.optimizer).__name__, job.scheduler.get_last_lr()[0] < Config().optim.lr
('AdamW', True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .. import models
from ..config import Config
from ..data import Data, build_data
from ..data.tokenizer import Tokenizer
from ..data.loader import Batch
from ..errors import UserError
from .kernels import attention_kernel
from ..distributed.agree import any_rank
from ..distributed.parallelize import parallelize
from ..models.attention import use_attention
from .finite import finite_guard
from .spikes import veto_for
from .loop import Job, standard_micro_step
from .optim import make_optimizer, make_scheduler
from .precision import Precision
from ..distributed.session import Session


def model_and_data(cfg: Config, rank: int = 0, world: int = 1,
                   tokenizer: Tokenizer | None = None) -> tuple[models.ModelSpec, Data]:
    """The model's spec and its data; `tokenizer`: a run folder's own, for its text (`build_data`)."""
    spec = models.from_config(cfg)
    # A step's rows come in one batch, cut into micro-batches by the loop: how a step is cut never
    # changes what it trains on (training/micro.py). Evaluation takes micro-batch-sized batches.
    data = build_data(cfg.data, spec, cfg.train.batch_size * cfg.train.grad_accum, cfg.run.seed, rank, world,
                      eval_batch_size=cfg.train.batch_size, tokenizer=tokenizer)
    for key, value in data.model_fit.items():
        if key in cfg.model.overrides and cfg.model.overrides[key] != value:
            raise UserError(f"model.{key}={cfg.model.overrides[key]} does not match the data, which has {value}: "
                            f"drop the setting or set --set model.{key}={value}")
    if data.model_fit:
        spec = models.from_config(cfg, data.model_fit)
    return spec, data


def model_and_shapes(cfg: Config, rank: int = 0, world: int = 1) -> tuple[models.ModelSpec, Data]:
    """`model_and_data` for what needs a step's shapes and not its words (a plan, a FLOP count): a
    language model's text becomes random ids of the same shape, so nothing is read or tokenised (a
    recipe's BPE is trained by the run that needs it). An image folder is still read: it sets the
    model's classes."""
    if models.from_config(cfg).family == "gpt" and cfg.data.kind in ("auto", "text"):
        cfg = replace(cfg, data=replace(cfg.data, kind="synthetic"))
    return model_and_data(cfg, rank, world)


@dataclass
class Task:
    """What a job trains for and on: the loss of a batch, the batches, and how to evaluate (optional)."""

    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
    batches: Iterator[Batch] = field(default_factory=lambda: iter(()))
    eval_fn: Callable[[nn.Module, Batch], dict[str, torch.Tensor]] | None = None
    eval_batches: Callable[[], Iterable[Batch]] | None = None
    draws: int = 1                # batches drawn per step (`micro.py`): a recipe draws the step's rows at once
    micro_batch: int = 0          # rows per forward (0: each drawn batch whole)


def build_job(model: nn.Module, cfg: Config, session: Session, precision: Precision, task: Task,
              materialize: Callable | None = None) -> Job:
    """`model` placed for this process's part of the job, with its optimizer and schedule.

    `cfg` gives the train, optim and parallel sections; `session` the device and the layout (a
    single process has none). A model on the meta device comes with `materialize(model, only)`,
    which `parallelize` calls for the parts this rank holds.
    """
    use_attention(model, attention_kernel(session.device, cfg.train.attention))
    placed = parallelize(model, session, cfg.parallel, precision.name, cfg.train, materialize,
                         fp8_emulate=precision.fp8_emulate)
    optimizer = make_optimizer(placed.model, cfg.optim, session.device.type)
    if placed.after_optimizer_step is not None:  # a hook, so that the loop stays free of strategy branches
        after = placed.after_optimizer_step
        optimizer.register_step_post_hook(lambda opt, args, kwargs: after())
    precision.linears = placed.float8_note  # the start block says it with the precision
    loss_fn = task.loss_fn
    if placed.cuda_graphs:
        loss_fn = _outside_the_graph(loss_fn)
        _stable_grads(placed.model)
    return Job(model=placed.model, loss_fn=loss_fn, optimizer=optimizer,
               scheduler=make_scheduler(optimizer, cfg.optim, cfg.train.max_steps), precision=precision,
               batches=task.batches, eval_fn=placed.eval_fn or task.eval_fn, eval_batches=task.eval_batches,
               grad_sync=placed.grad_sync, micro_step=placed.micro_step or standard_micro_step,
               clip_norm=placed.clip_norm, draws=task.draws, micro_batch=task.micro_batch,
               any_rank=_any_rank(session), device=session.device.torch_device,
               guard=finite_guard(session.device.torch_device, optimizer), grads_to_none=not placed.cuda_graphs,
               **_spike_veto(cfg, session))


def _outside_the_graph(loss_fn: Callable[[nn.Module, Batch], torch.Tensor]) -> Callable:
    """The loss copied out of the CUDA graph's memory (`train.compile = "reduce-overhead"`): the graph's
    next replay overwrites its outputs in place, and the monitor keeps a step's loss until the next log
    line. One copy of one number a micro-batch."""
    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        return loss_fn(model, batch).clone()
    return loss


def _stable_grads(model: nn.Module) -> None:
    """Gradient buffers made before the first backward, and zeroed rather than freed between steps
    (`Job.grads_to_none`): autograd adds each backward's gradients into them. Left to itself, autograd
    would keep the graph's own output buffers as the gradients, which the next replay (an accumulating
    step's next micro-batch) overwrites: wrong gradients or torch's error (torch issue 169545)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def _spike_veto(cfg: Config, session: Session) -> dict:
    """train.on_spike = "skip": the device veto, on the loss averaged over the data-parallel ranks."""
    veto = veto_for(cfg.train, cfg.optim.warmup_steps, session.reduce_mean)
    return {"spike_veto": veto} if veto is not None else {}


def _any_rank(session: Session) -> Callable[[bool], bool]:
    if session.world == 1:
        return lambda flag: flag
    return functools.partial(any_rank, group=session.control)
