"""What one pipeline rank's stages hold, phase by phase: traced on fake tensors (`pipeline.py` combines it).

The rank's model is built as training builds it (`split_model`: the same stages, the other ranks'
parts deleted; the attention kernel; activation checkpointing per stage; AdamW with its state),
and torch's MemTracker follows, per stage, two micro-batches as PipelineStage runs them (forward,
the last stage's loss, backward from the loss or from the received gradient, the input's gradient
taken off for its send), then the loop's update. Each phase gives its rise (the most it holds
above where it started) and its net (what it leaves), by category.

With data or tensor parallelism beside the pipeline, each stage is parallelized as training does
it (`parallelize_stage`: tensor parallelism, checkpointing, FSDP) on the caller's fake process
group, as rank 0 of its data and tensor groups, and FSDPMemTracker follows an FSDP stage.
PipelineStage drives such a stage its own way: no reduction and no resharding after each
micro-batch's backward, so the gathered weights and the whole unsharded gradients stay to the end
of the schedule run, where torch's `perform_reduce_grad` reduce-scatters them and lets the weights
go; that end is traced too (`StageTrace.reduce`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule

from .. import models
from ..config import Config
from ..errors import UserError
from ..data.loader import map_tensors
from ..device import cpu_info
from ..training.kernels import attention_kernel
from ..distributed.parallelize import apply_activation_checkpointing, checkpoint_mode, parallelize_stage
from ..distributed.parts import clip_grad_norm
from ..distributed.pipeline import StageLoss, split_model
from ..models.attention import use_attention
from ..training.optim import make_optimizer
from ..training.precision import Precision, make_precision
from .offload import OFFLOADED, in_the_update, offloads_to_host
from .trace import (CATEGORIES, _breakdown, _create_optimizer_state, _fake_model, _FSDPTracker, _meta_model,
                    _real_device_meshes, _resized, _Tracker, _untracked_propagation)

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
    # An FSDP stage's: the end of a schedule run (gradients reduce-scattered, weights let go), a forward
    # after a forward (a warm-up), a backward after a backward (a cool-down); `forward` and `backward`
    # are then 1F1B's steady state: a forward after a backward, a backward after a forward.
    reduce: Phase | None = None
    warm_forward: Phase | None = None
    cool_backward: Phase | None = None


@dataclass(frozen=True)
class RankTrace:
    static: Parts          # held between steps: parameters, optimizer state, the batches, the stage buffers
    stages: dict[int, StageTrace]
    update: Parts          # the rise of clipping and the optimizer step (every gradient held)
    inputs: int            # bytes of the batches among the static "inputs"; the rest are the stage buffers


def plus(a: Parts, b: Parts, sign: int = 1) -> Parts:
    """a + sign x b, category by category."""
    return {k: a.get(k, 0) + sign * b.get(k, 0) for k in CATEGORIES}


def trace_rank(cfg: Config, pp_rank: int, example: tuple[torch.Tensor, ...], session=None) -> RankTrace:
    """Pipeline rank `pp_rank`'s model, split and prepared as training does it, traced phase by phase.
    `session`: rank 0's of a job with data or tensor parallelism beside the pipeline (its mesh), else None."""
    spec = models.from_config(cfg)
    device = cpu_info()  # traced on this CPU's fake tensors, which may take any precision
    # fp8's stages are traced as bf16-mixed (`parallelize_stage` makes no float8 linears): the float8 copies
    # its linears keep for backward are left out of a pipeline's estimate (by how much: not yet measured).
    precision = make_precision(cfg.train.precision, dataclasses.replace(device, bf16=True, fp16=True, fp8=True))
    p = cfg.parallel
    split = split_model(_meta_model(spec), pp_rank, p, batch_size=cfg.train.batch_size,
                        precision_name=precision.name)
    rows = cfg.train.batch_size // p.pp_microbatches
    real = map_tensors(lambda t: _resized(t, cfg.train.batch_size * cfg.train.grad_accum), example)
    with FakeTensorMode() as fake, _real_device_meshes():
        _fake_model(split.model, precision.param_dtype, device.torch_device)  # in place: the stages share its parts
        use_attention(split.model, attention_kernel(device, cfg.train.attention))
        parts = [_prepared(stage, cfg, precision, session) for stage in split.stages]
        optimizer = make_optimizer(split.model, cfg.optim, device.type)
        _create_optimizer_state(optimizer)
        batch = map_tensors(fake.from_tensor, real)
        ahead = map_tensors(torch.empty_like, batch)  # the loader makes the next step's batch while a step runs
        # (rows, T, C): what stages pass on, in the dtype of the weights the stages compute with (autocast
        # leaves the residual stream alone; FSDP beside the pipeline gathers them in the compute dtype)
        hidden = torch.empty(rows, batch[0].shape[1], spec.config.d_model, dtype=_stream_dtype(precision, session))
        buffers = {s: _stage_buffers(s, split.n_stages, hidden, p.pp_microbatches) for s in split.stage_ids}
        received = [t for inputs, grads in buffers.values() for t in (*inputs, *grads)]
        tracker = _rank_tracker(split.model, parts, optimizer, [*batch, *ahead, *received])
        if isinstance(tracker, _FSDPTracker) and offloads_to_host(cfg):  # FSDP's shards in host memory
            tracker.host = OFFLOADED
        with tracker, _untracked_propagation(tracker):
            static = tracker.current()
            micro = (batch[0][:rows], batch[1][:rows])  # the schedule's micro-batches are views of the batch
            stages = {s: _trace_stage(tracker, stage, micro, buffers[s], precision, StageLoss(p.pp_microbatches))
                      for s, stage in zip(split.stage_ids, parts)}
            update = _update(tracker, optimizer, precision, cfg.train.grad_clip)
    inputs = sum(t.untyped_storage().nbytes() for t in (*batch, *ahead))
    return RankTrace(static, stages, update, inputs)


def _stream_dtype(precision: Precision, session) -> torch.dtype:
    from ..distributed.fsdp import mixed_precision_policy

    if session is not None and session.dims.dp > 1:  # FSDP gathers the weights in its policy's dtype
        return mixed_precision_policy(precision.name).param_dtype or precision.param_dtype
    return precision.param_dtype


def _prepared(stage: torch.nn.Module, cfg: Config, precision: Precision, session) -> torch.nn.Module:
    """The stage as training runs it: parallelized beside the pipeline (`session`), or checkpointed alone."""
    if session is not None:
        return parallelize_stage(stage, session, cfg.parallel, precision.name, cfg.train.activation_checkpointing)
    if checkpoint_mode(cfg.train.activation_checkpointing) != "off":
        apply_activation_checkpointing(stage, checkpoint_mode(cfg.train.activation_checkpointing))
    return stage


def _rank_tracker(model: torch.nn.Module, stages: list[torch.nn.Module], optimizer, inputs: list[torch.Tensor]):
    """torch's tracker for the rank: FSDPMemTracker, which knows FSDP's gathered weights, for an FSDP stage."""
    if not any(isinstance(stage, FSDPModule) for stage in stages):
        tracker = _Tracker()
        tracker.track_external(model, optimizer, *inputs)
        return tracker
    tracker = _FSDPTracker(stages[0], optimizer)
    if len(stages) > 1:  # several FSDP roots a rank: torch's tracker reads its one root's modules and buffers
        if not hasattr(tracker, "_root_mod"):
            raise UserError(f"torch {torch.__version__}'s FSDPMemTracker cannot follow several FSDP stages a rank: "
                            "the memory of interleaved-1f1b with FSDP beside it is not estimated; plan it with "
                            "parallel.pp_schedule=1f1b or gpipe")
        tracker._root_mod = torch.nn.ModuleList(stages)
    tracker.track_inputs(tuple(inputs))
    return tracker


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
    peak = _breakdown(tracker.get_tracker_snapshot("peak"), tracker.host)
    return Phase(plus(peak, start, -1), plus(tracker.current(), start, -1))


def _trace_stage(tracker: _Tracker, stage: torch.nn.Module, micro: tuple, buffers: tuple[list, list],
                 precision: Precision, loss: StageLoss) -> StageTrace:
    """Micro-batches through `stage` as PipelineStage runs them, in one autocast, as the pipeline's
    micro-step spans the whole schedule (the low-precision copies of the weights the first forward
    makes stay cached to the end of the schedule run). Two, one after the other: the step's first (its
    backward makes the gradients), then one whose backward adds to them. An FSDP stage's weights are
    gathered or not depending on what ran before, so three, in the orders 1F1B has: two forwards (a
    warm-up), two backwards (a cool-down), then a forward and a backward (the steady state)."""
    with precision.autocast():
        if not isinstance(stage, FSDPModule):
            f0 = _forward(tracker, stage, micro, buffers, loss, 0)
            first_backward, in_flight, output = _backward(tracker, stage, f0, buffers)
            f1 = _forward(tracker, stage, micro, buffers, loss, 1)
            backward, _, _ = _backward(tracker, stage, f1, buffers)
            return StageTrace(f0.phase, f1.phase, first_backward, backward, in_flight, output)
        f0, f1 = (_forward(tracker, stage, micro, buffers, loss, k) for k in (0, 1))
        first_backward, in_flight, output = _backward(tracker, stage, f0, buffers)
        cool_backward, _, _ = _backward(tracker, stage, f1, buffers)
        f2 = _forward(tracker, stage, micro, buffers, loss, 2)
        backward, _, _ = _backward(tracker, stage, f2, buffers)
        return StageTrace(f0.phase, f2.phase, first_backward, backward, in_flight, output, _reduce(tracker, stage),
                          f1.phase, cool_backward)


def _reduce(tracker: _Tracker, stage: FSDPModule) -> Phase:
    """The end of a schedule run for an FSDP stage, by torch's own code for it."""
    from torch.distributed.pipelining import PipelineStage

    if not hasattr(PipelineStage, "perform_reduce_grad"):
        raise UserError(f"torch {torch.__version__} ends an FSDP pipeline stage's run in a way gpudl does not "
                        "trace: its memory is not estimated; plan it with parallel.pp=1 or without data parallelism")
    start = _start(tracker)
    PipelineStage.perform_reduce_grad(SimpleNamespace(submod=stage), 1)  # it reads the stage's module alone
    return _since(tracker, start)


@dataclass
class _Forward:
    phase: Phase
    x: torch.Tensor        # the stage's input: a receive buffer (a leaf taking a gradient), or the token ids
    out: torch.Tensor | None
    value: torch.Tensor | None  # the last stage's loss
    k: int


def _forward(tracker: _Tracker, stage: torch.nn.Module, micro: tuple, buffers: tuple[list, list],
             loss: StageLoss, k: int) -> _Forward:
    """Micro-batch `k`'s forward (and the last stage's loss, taken right after it)."""
    ids, targets = micro
    received, grad_received = buffers
    # a stage after the first runs on its receive buffer, a leaf whose gradient goes back to the stage before
    x = received[k % len(received)].requires_grad_() if received else ids
    tracker.reset_mod_stats()  # torch's tracker refuses a module's second forward otherwise; totals stay
    start = _start(tracker)
    out = stage(x)
    value = loss(out, targets) if not grad_received else None  # the output is kept for the backward too
    return _Forward(_since(tracker, start), x, out, value, k)


def _backward(tracker: _Tracker, stage: torch.nn.Module, f: _Forward, buffers: tuple[list, list]
              ) -> tuple[Phase, Parts, Parts]:
    """(the backward, its input's gradient in flight, its output) of the micro-batch `f` ran forward."""
    received, grad_received = buffers
    start = _start(tracker)
    if isinstance(stage, FSDPModule):  # as PipelineStage.backward_maybe_with_nosync sets them for every backward
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)
    if grad_received:
        torch.autograd.backward(f.out, grad_tensors=grad_received[f.k % len(grad_received)])
    else:
        torch.autograd.backward(f.value)
    f.value = None
    holding = tracker.current()
    f.out = None
    output = plus(holding, tracker.current(), -1)
    sent = f.x.grad  # read and unset, as torch's stage_backward does, then sent (none on the first stage)
    if received:
        f.x.grad = None
    backward = _since(tracker, start)
    holding = tracker.current()
    del sent
    return backward, plus(holding, tracker.current(), -1), output


def _update(tracker: _Tracker, optimizer: torch.optim.Optimizer, precision: Precision, max_norm: float) -> Parts:
    """The rise of the loop's update: clip (the pipeline's norm also sums the other stages' squares, a
    scalar), the optimizer step, gradients unset. With CPU offload it runs on the host, its temporaries too."""
    tracker.host = in_the_update(tracker.host)
    start = _start(tracker)
    clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], max_norm)
    precision.step(optimizer, True)
    optimizer.zero_grad(set_to_none=True)
    return _since(tracker, start).rise
