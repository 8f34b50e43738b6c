"""What one pipeline rank's stages hold, phase by phase: traced on fake tensors (`pipeline.py` combines it).

The rank's model is built as training builds it (`split_model`: the same stages, the other ranks'
parts deleted; the attention kernel; activation checkpointing per stage; AdamW with its state),
and torch's MemTracker follows, per stage, two micro-batches as PipelineStage runs them (forward,
the last stage's loss, backward from the loss or from the received gradient, the input's gradient
taken off for its send), then the loop's update. Each phase gives its rise (the most it holds
above where it started) and its net (what it leaves), by category.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import models
from ..config import Config
from ..data.loader import map_tensors
from ..device import cpu_info
from ..device.kernels import attention_kernel
from ..distributed.parallelize import apply_activation_checkpointing, checkpoint_mode
from ..distributed.parts import clip_grad_norm
from ..distributed.pipeline import StageLoss, split_model
from ..models.attention import use_attention
from ..training.optim import make_optimizer
from ..training.precision import Precision, make_precision
from .trace import CATEGORIES, _breakdown, _create_optimizer_state, _fake_model, _meta_model, _resized, _Tracker

Parts = dict[str, int]  # trace.CATEGORIES -> bytes


@dataclass(frozen=True)
class Phase:
    rise: Parts  # the most it holds above where it started
    net: Parts   # what it leaves


@dataclass(frozen=True)
class StageTrace:
    first_forward: Phase   # a schedule run's first forward of the stage: it also makes the autocast copies
    forward: Phase         # one micro-batch's forward (and loss)
    first_backward: Phase  # the step's first backward of the stage: it makes the gradients
    backward: Phase        # a later one: it adds to them
    in_flight: Parts       # the input's gradient, held from its backward until it is sent
    output: Parts          # its output: sent to the next stage, or the last stage's logits


@dataclass(frozen=True)
class RankTrace:
    static: Parts          # held between steps: parameters, optimizer state, the batches, the stage buffers
    stages: dict[int, StageTrace]
    update: Parts          # the rise of clipping and the optimizer step (every gradient held)
    inputs: int            # bytes of the batches among the static "inputs"; the rest are the stage buffers


def plus(a: Parts, b: Parts, sign: int = 1) -> Parts:
    """a + sign x b, category by category."""
    return {k: a.get(k, 0) + sign * b.get(k, 0) for k in CATEGORIES}


def trace_rank(cfg: Config, pp_rank: int, example: tuple[torch.Tensor, ...]) -> RankTrace:
    """Pipeline rank `pp_rank`'s model, split and prepared as training does it, traced phase by phase."""
    spec = models.resolve(cfg.model.name, cfg.model.overrides)
    device = cpu_info()  # traced on this CPU's fake tensors, which may take any precision
    precision = make_precision(cfg.train.precision, dataclasses.replace(device, bf16=True, fp16=True))
    p = cfg.parallel
    split = split_model(_meta_model(spec), pp_rank, p, batch_size=cfg.train.batch_size,
                        precision_name=precision.name)
    rows = cfg.train.batch_size // p.pp_microbatches
    real = map_tensors(lambda t: _resized(t, cfg.train.batch_size * cfg.train.grad_accum), example)
    with FakeTensorMode() as fake:
        _fake_model(split.model, precision.param_dtype, device.torch_device)  # in place: the stages share its parts
        use_attention(split.model, attention_kernel(device, cfg.train.attention))
        if checkpoint_mode(cfg.train.activation_checkpointing) != "off":
            for stage in split.stages:
                apply_activation_checkpointing(stage, checkpoint_mode(cfg.train.activation_checkpointing))
        optimizer = make_optimizer(split.model, cfg.optim, device.type)
        _create_optimizer_state(optimizer)
        batch = map_tensors(fake.from_tensor, real)
        ahead = map_tensors(torch.empty_like, batch)  # the loader makes the next step's batch while a step runs
        # (rows, T, C): what stages pass on, in the parameters' dtype (autocast leaves the residual stream alone)
        hidden = torch.empty(rows, batch[0].shape[1], spec.config.d_model, dtype=precision.param_dtype)
        buffers = {s: _stage_buffers(s, split.n_stages, hidden, p.pp_microbatches) for s in split.stage_ids}
        tracker = _Tracker()
        received = [t for inputs, grads in buffers.values() for t in (*inputs, *grads)]
        tracker.track_external(split.model, optimizer, *batch, *ahead, *received)
        with tracker:
            static = tracker.current()
            micro = (batch[0][:rows], batch[1][:rows])  # the schedule's micro-batches are views of the batch
            stages = {s: _trace_stage(tracker, stage, micro, buffers[s], precision, StageLoss(p.pp_microbatches))
                      for s, stage in zip(split.stage_ids, split.stages)}
            update = _update(tracker, optimizer, precision, cfg.train.grad_clip)
    inputs = sum(t.untyped_storage().nbytes() for t in (*batch, *ahead))
    return RankTrace(static, stages, update, inputs)


def _stage_buffers(stage: int, n_stages: int, hidden: torch.Tensor, n: int) -> tuple[list, list]:
    """PipelineStage's receive buffers, one per micro-batch, kept from the first step on: the input
    activations (all stages but the first) and the output's gradients (all but the last)."""
    inputs = [torch.empty_like(hidden) for _ in range(n)] if stage > 0 else []
    grads = [torch.empty_like(hidden) for _ in range(n)] if stage < n_stages - 1 else []
    return inputs, grads


def _start(tracker: _Tracker) -> Parts:
    tracker.restart_peak()
    return tracker.current()


def _since(tracker: _Tracker, start: Parts) -> Phase:
    return Phase(plus(_breakdown(tracker.get_tracker_snapshot("peak")), start, -1), plus(tracker.current(), start, -1))


def _trace_stage(tracker: _Tracker, stage: torch.nn.Module, micro: tuple, buffers: tuple[list, list],
                 precision: Precision, loss: StageLoss) -> StageTrace:
    """Two micro-batches through `stage` as PipelineStage runs them: the step's first (its backward
    makes the gradients), then one whose backward adds to them. One autocast spans both, as the
    pipeline's micro-step spans the whole schedule: the low-precision copies of the weights the
    first forward makes stay cached for the others (to the end of the schedule run)."""
    with precision.autocast():
        first_forward, first_backward, in_flight, output = _one_micro(tracker, stage, micro, buffers, loss, 0)
        forward, backward, _, _ = _one_micro(tracker, stage, micro, buffers, loss, 1)
    return StageTrace(first_forward, forward, first_backward, backward, in_flight, output)


def _one_micro(tracker: _Tracker, stage: torch.nn.Module, micro: tuple, buffers: tuple[list, list],
               loss: StageLoss, k: int) -> tuple[Phase, Phase, Parts, Parts]:
    """(forward, backward, its input's gradient in flight, its output) of micro-batch `k`."""
    ids, targets = micro
    received, grad_received = buffers
    # a stage after the first runs on its receive buffer, a leaf whose gradient goes back to the stage before
    x = received[k % len(received)].requires_grad_() if received else ids
    tracker.reset_mod_stats()  # torch's tracker refuses a module's second forward otherwise; totals stay
    start = _start(tracker)
    out = stage(x)
    # the last stage's loss is taken right after its forward; the output is kept for the backward too
    value = loss(out, targets) if not grad_received else None
    forward = _since(tracker, start)
    start = _start(tracker)
    if grad_received:
        torch.autograd.backward(out, grad_tensors=grad_received[k % len(grad_received)])
    else:
        torch.autograd.backward(value)
    del value
    holding = tracker.current()
    del out
    output = plus(holding, tracker.current(), -1)
    sent = x.grad  # read and unset, as torch's stage_backward does, then sent (none on the first stage)
    if received:
        x.grad = None
    backward = _since(tracker, start)
    holding = tracker.current()
    del sent
    return forward, backward, plus(holding, tracker.current(), -1), output


def _update(tracker: _Tracker, optimizer: torch.optim.Optimizer, precision: Precision, max_norm: float) -> Parts:
    """The rise of the loop's update: clip (the pipeline's norm also sums the other stages' squares, a
    scalar), the optimizer step, gradients unset."""
    start = _start(tracker)
    clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], max_norm)
    precision.step(optimizer, True)
    optimizer.zero_grad(set_to_none=True)
    return _since(tracker, start).rise
