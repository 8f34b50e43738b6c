"""The one function that prepares a model for training, in one fixed order.

Order (torchtitan's): pipeline split -> float8 linears (precision fp8) -> tensor parallelism ->
activation checkpointing -> compile -> FSDP or DDP. Each step is a plain function in its own
module; `parallelize` is the only place that knows the order. After a pipeline split the other
steps apply to each stage as if it were the model (torchtitan's "model parts").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from ..config import ParallelConfig, TrainConfig
from ..errors import UserError
from .mesh import ParallelDims
from .parts import Parallelized

if TYPE_CHECKING:  # the session is built from distributed/'s pieces; only its type is needed here
    from .session import Session


def block_units(model: nn.Module) -> list[nn.Module]:
    """The blocks of a model: its own list, else its largest ModuleList, else none."""
    if hasattr(model, "activation_checkpoint_units"):
        return list(model.activation_checkpoint_units())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def checkpoint_units(model: nn.Module) -> list[nn.Module]:
    """The blocks whose activations are recomputed; a model without any cannot be checkpointed."""
    units = block_units(model)
    if not units:
        raise UserError("train.activation_checkpointing needs a model with a list of blocks (an nn.ModuleList, "
                        "or an activation_checkpoint_units() method): add one or turn it off")
    return units


def checkpoint_mode(setting: bool | str) -> str:
    """`train.activation_checkpointing` as "off", "full" or "selective" (true is "full")."""
    if isinstance(setting, bool):
        return "full" if setting else "off"
    return setting


@functools.cache
def _saved_by_selective() -> frozenset:
    """The operators whose outputs selective checkpointing keeps: matrix products, attention and
    convolutions, the expensive ones. Everything else in a block (norms, activations, dropout,
    residual adds, casts) is recomputed in backward: cheap in FLOPs, and most of the bytes."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _selective_context():
    saved = _saved_by_selective()

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> nn.Module:
    """Recompute each block's activations in backward instead of keeping them: all of them
    ("full"), or all but the outputs of its matmuls, attention and convolutions ("selective":
    less memory saved, and almost no FLOPs recomputed).

    The block's forward is replaced on the instance, so parameter names (and therefore
    checkpoints) are the same with and without it.
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use full or selective")
    context = {"full": noop_context_fn, "selective": _selective_context}[mode]
    for unit in checkpoint_units(model):
        unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False, context_fn=context)
    return model


# train.compile's value that adds CUDA graphs to inductor's kernels (torch.compile's own mode name).
CUDA_GRAPHS = "reduce-overhead"


def apply_compile(model: nn.Module, mode: str | None = None) -> nn.Module:
    """Compile in place (`nn.Module.compile`), which keeps parameter names unchanged.

    `mode="reduce-overhead"` also records the compiled forward and backward as CUDA graphs (inductor's
    cudagraph trees), replayed each step: a launch per graph instead of one per kernel, which is what a
    step of a small model spends its time on. Only the model is graphed: the optimizer step, clipping,
    the finiteness guard and the schedule run outside, so the learning rate is never baked into a graph,
    and dynamo guards every Python value the forward reads (a change recompiles, never replays stale).
    """
    model.compile(mode=mode)
    return model


def compile_wanted(setting: bool | str, device_type: str) -> bool:
    """Whether the model is compiled at all. "auto" here is the rule for a job nobody timed (`gpudl plan`,
    `gpudl bench`, a device `run/autotune.py` does not probe): on for CUDA and XPU where Triton is
    present, off on the CPU, where compile time dominates short runs. Recipes and fit on a GPU replace
    "auto" by what the probe measured before they get here."""
    if setting == "auto":
        return device_type in ("cuda", "xpu") and _triton_present()
    return bool(setting)


def compile_mode(setting: bool | str, device_type: str) -> str | None:
    """`train.compile` as torch.compile's mode: None (eager), "default" (inductor) or "reduce-overhead"."""
    if setting == CUDA_GRAPHS:
        return CUDA_GRAPHS
    return "default" if compile_wanted(setting, device_type) else None


def cuda_graphs_blocker(device_type: str, world: int, parallel: ParallelConfig,
                        activation_checkpointing: bool | str) -> str | None:
    """Why CUDA graphs cannot hold this job's forward and backward (None: they can)."""
    if device_type != "cuda":
        return f"needs a CUDA GPU, and this job runs on the {device_type}"
    if world > 1 or parallel.fsdp_cpu_offload:
        # DDP's and FSDP's hooks and the collectives of TP and pipelines run between the graphed kernels
        return "runs in one process only, without DDP, FSDP, tensor or pipeline parallelism"
    if checkpoint_mode(activation_checkpointing) != "off":
        return "cannot be combined with activation checkpointing (its recomputation runs inside the backward)"
    return None


def check_compile(setting: bool | str, device_type: str, world: int, parallel: ParallelConfig,
                  activation_checkpointing: bool | str) -> None:
    """Refuse `train.compile = "reduce-overhead"`, in one line, where CUDA graphs cannot work."""
    if setting != CUDA_GRAPHS:
        return
    why = cuda_graphs_blocker(device_type, world, parallel, activation_checkpointing)
    if why is not None:
        raise UserError(f"train.compile='reduce-overhead' (CUDA graphs) {why}: set --set train.compile=true "
                        f"(gpudl.fit: compile=True)")


def _triton_present() -> bool:
    from importlib.util import find_spec

    return find_spec("triton") is not None


@dataclass(frozen=True)
class _Layout:
    """What each step of the order needs: the job's layout and the training options that shape the model."""

    dims: ParallelDims | None
    mesh: DeviceMesh | None
    device: torch.device
    parallel: ParallelConfig
    precision_name: str
    activation_checkpointing: bool | str   # train.activation_checkpointing: false, true, "full" or "selective"
    compile: str | None                    # torch.compile's mode (`compile_mode`); None: eager
    fp8_recipe: str | None = None          # train.fp8_recipe where the precision is fp8, else None
    fp8_emulate: bool = False              # the precision's fp8_emulate (tests on the CPU)

    @property
    def data_parallel(self) -> bool:
        return self.dims is not None and self.mesh is not None and (self.dims.dp > 1 or self.parallel.fsdp_cpu_offload)

    @property
    def sharded(self) -> bool:
        """Data parallelism through FSDP2 (not DDP): see `_data_parallel`."""
        dims, offload = self.dims, self.parallel.fsdp_cpu_offload
        return self.data_parallel and (dims.dp_shard > 1 or dims.tp > 1 or dims.pp > 1 or offload)

    @property
    def fp8_all_gather(self) -> bool:
        """FSDP2 all-gathers float8 weights: tensorwise scaling only (torchao's). Not with CPU offload: untried
        there (the float8 casts of the shards would run on the host)."""
        return self.fp8_recipe == "tensorwise" and self.sharded and not self.parallel.fsdp_cpu_offload


def _data_parallel(model: nn.Module, layout: _Layout) -> Parallelized:
    # DDP cannot hold DTensor parameters, nor serve two pipeline stages of one rank (its reducer
    # asserts): with tensor or pipeline parallelism, replication too goes through FSDP2, on a
    # (dp_replicate, dp_shard=1) mesh: shards of one rank, gradients all-reduced.
    dims, mesh, cfg = layout.dims, layout.mesh, layout.parallel
    if layout.sharded:
        from .fsdp import apply_fsdp, fsdp_grad_sync

        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        model = apply_fsdp(model, block_units(model), dp_mesh, layout.precision_name,
                           cfg.fsdp_reshard_after_forward, cfg.fsdp_cpu_offload)
        return Parallelized(model, grad_sync=fsdp_grad_sync(model, every_micro_batch=cfg.fsdp_cpu_offload))
    from .ddp import apply_ddp, ddp_grad_sync

    model = apply_ddp(model, mesh["dp_replicate"], layout.device)
    return Parallelized(model, grad_sync=ddp_grad_sync(model))


def parallelize(model: nn.Module, session: Session, parallel: ParallelConfig, precision_name: str,
                train: TrainConfig, materialize: Callable | None = None, fp8_emulate: bool = False) -> Parallelized:
    """Apply, in order: pipeline split, float8 linears (fp8), tensor parallelism, activation checkpointing,
    compile, FSDP or DDP.

    The layout comes from `session` (its degrees, mesh and device; one process has none), the
    options from `train` (activation checkpointing, compile, the batch size a pipeline splits, the
    fp8 recipe). `model` may come on the meta device with `materialize(model, only=names)`, which
    allocates and initialises it: a pipeline rank allocates only the parts it holds (`only=None`:
    everything). `fp8_emulate`: the precision's (`Precision.fp8_emulate`).
    """
    device = session.device.torch_device
    check_compile(train.compile, device.type, session.world, parallel, train.activation_checkpointing)  # fit too
    layout = _Layout(session.dims, session.mesh, device, parallel, precision_name, train.activation_checkpointing,
                     compile_mode(train.compile, device.type),
                     fp8_recipe=train.fp8_recipe if precision_name == "fp8" else None, fp8_emulate=fp8_emulate)
    if layout.dims is not None and layout.dims.pp > 1:
        placed = _pipeline(model, layout, materialize, train.batch_size)
    else:
        if materialize is not None:
            materialize(model, only=None)
        placed = _after_split(model, layout)
    placed.cuda_graphs = layout.compile == CUDA_GRAPHS
    return _with_float8_parts(placed, layout)


def _with_float8_parts(placed: Parallelized, layout: _Layout) -> Parallelized:
    """fp8: the start block's note, and the scales FSDP's fp8 all-gather wants after each optimizer step."""
    if layout.fp8_recipe is None:
        return placed
    from .float8 import float8_note, scale_precompute

    placed.float8_note = float8_note(placed.model, layout.fp8_recipe)
    if layout.fp8_all_gather:
        placed.after_optimizer_step = scale_precompute(placed.model)
    return placed


def _after_split(model: nn.Module, layout: _Layout) -> Parallelized:
    """Float8 linears, tensor parallelism, activation checkpointing, compile, FSDP or DDP: of the model or of
    one stage."""
    if layout.fp8_recipe is not None:
        from .float8 import apply_float8, check_float8_layout

        check_float8_layout(layout.dims.tp if layout.dims is not None else 1)  # gpudl.fit has no preflight
        apply_float8(model, layout.fp8_recipe, emulate=layout.fp8_emulate, fsdp=layout.fp8_all_gather)
    if layout.dims is not None and layout.dims.tp > 1:
        from .tensor import apply_tp

        apply_tp(model, layout.mesh["tp"], sequence_parallel=layout.parallel.tp_sequence_parallel)
    mode = checkpoint_mode(layout.activation_checkpointing)
    if mode != "off":
        apply_activation_checkpointing(model, mode)
    if layout.compile is not None:
        apply_compile(model, None if layout.compile == "default" else layout.compile)
    return _data_parallel(model, layout) if layout.data_parallel else Parallelized(model)


def parallelize_stage(stage: nn.Module, session: Session, parallel: ParallelConfig, precision_name: str,
                      activation_checkpointing: bool | str) -> nn.Module:
    """One pipeline stage parallelized as `parallelize` does it beside the pipeline (tensor parallelism,
    checkpointing, FSDP), uncompiled: what the memory estimate traces (`memory/pipeline_trace.py`)."""
    layout = _Layout(session.dims, session.mesh, session.device.torch_device, parallel, precision_name,
                     activation_checkpointing, compile=None)
    return _after_split(stage, layout).model


def _pipeline(model: nn.Module, layout: _Layout, materialize: Callable | None, batch_size: int) -> Parallelized:
    from .pipeline import pipeline_parallelized, split_model

    pp_mesh = layout.mesh["pp"]
    split = split_model(model, pp_mesh.get_local_rank(), layout.parallel, batch_size=batch_size,
                        precision_name=layout.precision_name, materialize=materialize)
    # The rest of the order, for each stage as if it were the model. The rank model keeps the plain
    # names for the optimizer and checkpoints; PipelineStage drives an FSDP stage's gradient syncs.
    parts = [_after_split(stage, layout).model for stage in split.stages]
    return pipeline_parallelized(split, parts, pp_mesh, layout.parallel, layout.device)
