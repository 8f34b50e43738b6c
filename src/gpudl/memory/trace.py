"""One training step traced on fake tensors: the peak of live tensor bytes on one rank, by what holds them.

The job is built by `build_job`, the same as training builds it (attention kernel, parallelize in
its one order, optimizer, schedule), but inside `FakeTensorMode`: every tensor has a shape, a
dtype and a device and no storage, so GPT-2 1.5B is traced on a laptop. torch's own `MemTracker`
(`FSDPMemTracker` for a sharded job) follows every allocation and free of one steady step (the
optimizer state a first step would have made is made beforehand) and keeps the breakdown at the
peak.

A job of several processes is traced as its rank 0, in a process whose default group is torch's
fake process group (collectives return at once): sharding, tensor parallelism and their
communication buffers are gpudl's real code paths. DDP cannot be traced so (its C++ reducer reads
tensor data) and neither can a pipeline schedule (its stages exchange shapes): DDP is the
one-process trace with its buckets modelled, a pipeline its ranks' stages traced on their own and
combined by formula (`pipeline.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

from .. import models
from ..config import Config
from ..data.loader import map_tensors, tensors_in
from ..distributed.parallelize import block_units
from ..training.job import Task, build_job
from ..training.loop import Job, clip_gradients, forward_backward
from ..training.micro import micro_batches
from ..training.precision import make_precision
from ..distributed.session import Session
from .offload import OFFLOADED, in_the_update, offloads_to_host, on_device

# What holds the bytes, as gpudl reports it; torch's trackers name them their own way. "host": what
# FSDP's CPU offload keeps in host memory beside an accelerator's (not part of the device's peak).
CATEGORIES = ("params", "buffers", "grads", "optimizer", "activations", "temporaries", "inputs", "communication",
              "other", "host")
_CATEGORY_OF = {"PARAM": "params", "SHARDED_PARAM": "params", "UNSHARDED_PARAM": "params", "BUFFER": "buffers",
                "GRAD": "grads", "SHARDED_GRAD": "grads", "UNSHARDED_GRAD": "grads", "ACT": "activations",
                "TEMP": "temporaries", "OPT": "optimizer", "INP": "inputs", "ALL_GATHER": "communication",
                "REDUCE_SCATTER": "communication",
                "OTH": "inputs"}  # MemTracker's "other" is what we register besides model and optimizer: the batch


Parts = dict[str, int]        # CATEGORIES -> bytes
Phases = dict[str, Parts]     # a piece of the step (`_Pieces`) -> bytes by category at that piece's own peak


def at_peak(phases: Phases) -> Parts:
    """The breakdown at the device's peak: that of the piece whose own peak is the highest."""
    return max(phases.values(), key=on_device)


def trace_step(cfg: Config, session: Session, example: tuple[torch.Tensor, ...], ddp: bool = False) -> Phases:
    """Bytes by category at the peak of each piece of a steady training step of `cfg`'s model on this rank.

    `example` is one real batch of the data (its shapes and dtypes are all that is used);
    `cfg.train.batch_size` is the micro-batch traced. `ddp`: the one-process job with DDP's
    gradient buckets in it (`_DDPBuckets`), as one rank of a DDP job holds them.
    """
    spec = models.from_config(cfg)
    return trace_model(_meta_model(spec), models.loss_for(spec), cfg, session, example, ddp)


def trace_module(module: torch.nn.Module, loss_fn, cfg: Config, session: Session, example,
                 ddp: bool = False) -> Parts:
    """`trace_step` of a user's own module (`fit`) and its loss; the module itself is left untouched:
    the trace runs on a copy whose parameters and buffers are made on the meta device (no values copied)."""
    return at_peak(trace_model(models.meta_copy(module), loss_fn, cfg, session, example, ddp))


def trace_model(meta: torch.nn.Module, loss_fn, cfg: Config, session: Session, example, ddp: bool) -> Phases:
    """The trace itself, of `meta` (a model on the meta device, made fake here in place)."""
    # Nothing runs, so the traced device may take any precision the job asks for (bf16 on a CPU without it;
    # fp8's float8 linears as on the GPU: fake tensors run their casts and matmuls' shapes, not their kernels).
    precision = make_precision(cfg.train.precision, dataclasses.replace(session.device, bf16=True, fp16=True,
                                                                        fp8=True))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))
    # The loader draws a step's rows at once and the loop cuts them into micro-batches (views).
    real = map_tensors(lambda t: _resized(t, cfg.train.batch_size * cfg.train.grad_accum), example)
    with FakeTensorMode() as fake, _real_device_meshes():
        model = _fake_model(meta, precision.param_dtype, session.device.torch_device)
        batch = map_tensors(fake.from_tensor, real)
        ahead = map_tensors(torch.empty_like, batch)  # the loader copies the next step's batch while a step runs
        job = build_job(model, cfg, session, precision, Task(loss_fn, _repeat(batch), micro_batch=cfg.train.batch_size))
        _create_optimizer_state(job.optimizer)
        if ddp:
            buckets = _DDPBuckets(job.model)
            job.grad_sync = buckets.grad_sync
        held = [*tensors_in(batch), *tensors_in(ahead)]
        tracker = _tracker(job, held, buckets.flat if ddp else None)
        with tracker, _untracked_propagation(tracker):
            phases = _step(job, cfg, batch, tracker)
    inputs = sum(t.untyped_storage().nbytes() for t in held)
    # A one-process tracker files everything registered beside model and optimizer under one name
    return {name: {**parts, "inputs": inputs, "communication": parts["communication"] + parts["inputs"] - inputs}
            for name, parts in phases.items()}


class _DDPBuckets:
    """What DDP (gradient_as_bucket_view, as gpudl wraps it) does with gradients, for a trace that cannot
    run DDP itself (its C++ reducer reads tensor data): one flat buffer of every gradient, allocated
    with the model; in a backward that synchronises, each gradient, once accumulated, is copied into
    its view there and then freed. Under `no_sync` (the micro-batches before an accumulating step's
    last) gradients stay tensors of their own, beside the buffer."""

    def __init__(self, model: torch.nn.Module):
        params = [p for p in model.parameters() if p.requires_grad]
        self.flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offsets = itertools.accumulate((p.numel() for p in params), initial=0)
        self.views = {p: self.flat[start:start + p.numel()].view_as(p) for p, start in zip(params, offsets)}
        self.syncing = True
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p: torch.Tensor) -> None:
        if self.syncing:
            self.views[p].copy_(p.grad)
            p.grad = self.views[p]

    @contextmanager
    def grad_sync(self, last: bool):
        self.syncing = last
        try:
            yield
        finally:
            self.syncing = True


def _meta_model(spec: models.ModelSpec) -> torch.nn.Module:
    model = models.build_meta(spec)
    model.init_weights()  # on the meta device: layouts (channels-last) and ties, no values
    return model


def _fake_model(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """`model` (on the meta device) with fake parameters and buffers of the same strides, in place.

    A fake model cannot be made by converting one (`Module._apply` swaps fake tensors, which fails).
    """
    fakes: dict[int, torch.Tensor] = {}  # tied weights (GPT's embedding and head) stay one tensor

    def fake(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        if id(t) not in fakes:
            new = torch.empty_strided(t.shape, t.stride(), dtype=dtype if t.is_floating_point() else t.dtype,
                                      device=device)
            fakes[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if is_param else new
        return fakes[id(t)]
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake(p, True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b, False)
    return model


def _resized(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with `rows` rows (its values do not matter: only shapes reach the fake tensors); a scalar stays."""
    return t[:1].expand(rows, *t.shape[1:]).contiguous() if t.dim() else t


def _repeat(batch) -> Iterator:
    while True:
        yield batch


class _GlobalPeak:
    """Keep only the global peak. torch's trackers also keep every module's own peak, updated after
    every operator by walking all modules: quadratic in model size (GPT-2 124M: 7 s a trace, 1.5B:
    two minutes), for figures gpudl does not report. The totals they keep per operator are unchanged.
    Device queries and DTensor's shape propagation go through untracked (`__torch_dispatch__`)."""

    in_propagation = False
    host: frozenset = frozenset()  # the trackers' kinds that `current` files as "host" (offload.OFFLOADED)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default or self.in_propagation:
            # a device query allocates nothing (three in four operators of a trace are one), nor does DTensor's
            # shape propagation, which runs each operator on global-shape fakes in the active fake mode (ours)
            return func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        scratch = kernel_scratch(func, args)
        if scratch and self._curr_mem_snap:
            self._count_scratch(scratch)
        return out

    def _count_scratch(self, nbytes: int) -> None:
        """A buffer the real kernel allocates inside and frees before it returns: at the peak, not after."""
        for sign in (1, -1):
            for snap in self._curr_mem_snap.values():
                temp = next(key for key in snap if getattr(key, "name", "") == "TEMP")
                snap["Total"] += sign * nbytes
                snap[temp] += sign * nbytes
            if sign == 1:
                self._update_peak_stats(None)

    def current(self) -> dict[str, int]:
        """Bytes by category live now."""
        return _breakdown(self.get_tracker_snapshot("current"), self.host)

    def restart_peak(self) -> None:
        """Forget the peak so far, so that the next one read is of what runs from here (one phase of a step)."""
        self._peak_mem = {device: snap["Total"] for device, snap in self._curr_mem_snap.items()}
        self._peak_mem_snap = {device: dict(snap) for device, snap in self._curr_mem_snap.items()}

    def _update_peak_stats(self, peak_state) -> None:
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap["Total"]:
                self._peak_mem[device] = snap["Total"]
                self._peak_mem_snap[device] = dict(snap)


@contextmanager
def _untracked_propagation(tracker: _GlobalPeak):
    """While DTensor propagates an operator's output shapes (on fakes of the global shape, which no real run
    allocates), the tracker lets its operators through uncounted."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        tracker.in_propagation = True
        try:
            return original(self, op_schema)
        finally:
            tracker.in_propagation = False
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


@contextmanager
def _real_device_meshes():
    """A DeviceMesh holds a small real tensor of ranks; FSDP makes one while it wraps tensor-parallel
    weights (inside the trace's fake mode, where finding this rank in it cannot run): made outside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)
    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


def kernel_scratch(func, args) -> int:
    """Bytes a real kernel allocates for itself while it runs, which a fake kernel (shapes only) does not.

    Measured, not guessed (the CPU allocator's own log around each operator of a real ResNet-18
    step): oneDNN's convolution backward on the CPU holds buffers of the weight's size beside its
    outputs while it reorders the weight gradient, two for a channels-last weight and one for a
    contiguous one. Kernels of other devices are not modelled (cuDNN's workspace is its own).
    """
    if func is torch.ops.aten.convolution_backward.default and args[2].device.type == "cpu":
        weight = args[2]
        reorders = 1 if weight.is_contiguous() else 2  # channels-last
        return reorders * weight.numel() * weight.element_size()
    return 0


class _Tracker(_GlobalPeak, MemTracker):
    pass


class _FSDPTracker(_GlobalPeak, FSDPMemTracker):
    pass


def _tracker(job: Job, inputs: list[torch.Tensor], buckets: torch.Tensor | None) -> MemTracker:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(job.model, FSDPModule):
        tracker = _FSDPTracker(job.model, job.optimizer)
        tracker.track_inputs(tuple(inputs))
        return tracker
    tracker = _Tracker()
    tracker.track_external(job.model, job.optimizer, *inputs, *([buckets] if buckets is not None else []))
    return tracker


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The state the first step leaves (AdamW's moments), made by an update with zero gradients: the
    traced step is then a steady one, at the cost of one optimizer update instead of a whole step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _step(job: Job, cfg: Config, batch, tracker: MemTracker) -> Phases:
    """The loop's step without its finiteness check (a fake tensor has no value to test), phase by
    phase. Of an accumulating step, two micro-batches are enough: from the second on, each runs
    with the gradients of those before it held, and the last one synchronises them. (The trackers
    take a second forward of the model for a new step unless their per-module figures are reset.)"""
    if isinstance(tracker, _FSDPTracker) and offloads_to_host(cfg):  # FSDP's shards in host memory
        tracker.host = OFFLOADED
    pieces = _Pieces(tracker, job.model)
    micros = micro_batches([batch], cfg.train.batch_size)
    if len(micros) > 1:
        with job.grad_sync(False):
            job.micro_step(job, micros[0], 1 / len(micros))
        tracker.reset_mod_stats()
    forward_backward(job, micros[-1:])
    pieces.close("forward-backward end")
    tracker.host = in_the_update(tracker.host)
    clip_gradients(job, cfg.train.grad_clip)
    job.precision.step(job.optimizer, True)
    job.optimizer.zero_grad(set_to_none=True)
    pieces.close("update")
    return pieces.found


class _Pieces:
    """The step cut where each block's forward and backward begin and end, where the model's forward
    ends (inside autocast, whose cache of low-precision weights, a copy per block, goes when it
    ends) and where its backward begins, with the peak of each piece.

    A piece is named by the boundary that ends it, the block there as one of the first two, the last
    two or "mid" (in between), and how many pieces of that name came before: the same piece of a
    model of other depth has the same name (`depth.py` extrapolates them). Within a piece nothing
    held per block is made or freed, so the point of its peak does not move with depth. The update
    (clipping and the optimizer step) is one piece: its operators take every parameter at once
    (foreach), so the same holds for it."""

    def __init__(self, tracker: _GlobalPeak, model: torch.nn.Module):
        self.tracker, self.found, self.seen = tracker, {}, collections.Counter()
        model.register_forward_hook(functools.partial(self._after, "model"))
        blocks = block_units(model)
        for j, block in enumerate(blocks):
            where = str(j) if j < 2 else f"end-{len(blocks) - 1 - j}" if j >= len(blocks) - 2 else "mid"
            block.register_forward_pre_hook(functools.partial(self._before, where))
            block.register_forward_hook(functools.partial(self._after, where))

    def close(self, name: str) -> None:
        """Keep the peak since the last boundary as piece `name`, and start the next piece."""
        self.found[f"{name} #{self.seen[name]}"] = _breakdown(self.tracker.get_tracker_snapshot("peak"),
                                                              self.tracker.host)
        self.seen[name] += 1
        self.tracker.restart_peak()

    def _before(self, where: str, module, args) -> None:
        self.close(f"forward {where}")
        self._on_gradient(args, f"backward end {where}")

    def _after(self, where: str, module, args, output) -> None:
        self.close(f"forward end {where}")
        self._on_gradient(output, f"backward {where}")

    def _on_gradient(self, tensors, name: str) -> None:
        """Close a piece when the gradient of the first of `tensors` that takes one is computed."""
        needing = [t for t in tensors_in(tensors) if t.requires_grad]
        if needing and torch.is_grad_enabled():
            needing[0].register_hook(lambda grad: self.close(name))


def _breakdown(snapshot: dict, host: frozenset = frozenset()) -> dict[str, int]:
    """Bytes by category; the trackers' kinds named in `host` are the host's."""
    out = dict.fromkeys(CATEGORIES, 0)
    for device_stats in snapshot.values():
        for kind, nbytes in device_stats.items():
            if kind != "Total":  # the others are the trackers' enum members: named by their member name
                name = getattr(kind, "name", str(kind))
                out["host" if name in host else _CATEGORY_OF.get(name, "other")] += int(nbytes)
    return out
