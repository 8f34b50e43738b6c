"""What a parallel strategy hands the training loop: the placed model and the few pieces that
differ by strategy (gradient sync context, global gradient norm, a pipeline's own micro step,
work after the optimizer step)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _settle_partial_grads(params: list[torch.Tensor]) -> None:
    """Sum gradients that are still partial sums over ranks (a replicated weight used on sequence
    shards under tensor parallelism) into the parameter's own layout, before norms and updates.
    Some torch releases do this inside the optimizer and some (2.11) do not: do it here, once."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor:
    """The global gradient norm (a plain tensor, also for sharded gradients); clip to `max_norm` if > 0.

    `group`: ranks that hold other parameters of the model (pipeline stages); the norm covers theirs
    too, so that clipping and the finiteness guard decide the same on each of them.
    """
    _settle_partial_grads(params)
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):  # sharded gradients (FSDP, TP): reduce the partial norms to the full one
        norm = norm.full_tensor()
    if group is not None:
        squares = norm.float().square()
        dist.all_reduce(squares, group=group)
        norm = squares.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


@dataclass
class Parallelized:
    """A model ready for the loop, and the strategy-specific pieces the loop calls."""

    model: nn.Module
    # Context around a micro-batch's forward and backward; `last` is the step's last micro-batch.
    grad_sync: Callable[[bool], AbstractContextManager] = field(default=lambda last: nullcontext())
    # Global gradient norm (and clipping) over the parameters this rank holds.
    clip_norm: Callable[[list[torch.Tensor], float], torch.Tensor] = clip_grad_norm
    # A pipeline runs forward and backward itself: (job, batch, scale) -> detached loss.
    micro_step: Callable | None = None
    # A pipeline evaluates through its schedule: (model, batch) -> {"loss": ...}.
    eval_fn: Callable | None = None
    # Run after every optimizer step (fp8 with FSDP2: the float8 weights' scales for the next all-gather).
    after_optimizer_step: Callable[[], None] | None = None
    # precision fp8: which linears are float8 and why the others are not, for the start block.
    float8_note: str = ""
    # train.compile = "reduce-overhead": forward and backward replay CUDA graphs, whose outputs the next
    # replay overwrites; `build_job` makes the step keep nothing of them past it.
    cuda_graphs: bool = False
