"""The one function that prepares a model for training, in one fixed order.

Order (torchtitan's): pipeline split -> tensor parallelism -> activation checkpointing ->
compile -> FSDP or DDP. Each step is a plain function in its own module; `parallelize` is the
only place that knows the order. After a pipeline split the other steps apply to each stage
as if it were the model (torchtitan's "model parts").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from ..config import ParallelConfig
from ..errors import UserError
from .mesh import ParallelDims
from .parts import Parallelized


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


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in backward instead of keeping them.

    The block's forward is replaced on the instance, so parameter names (and therefore
    checkpoints) are the same with and without it.
    """
    for unit in checkpoint_units(model):
        unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False)
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile in place (`nn.Module.compile`), which keeps parameter names unchanged."""
    model.compile()
    return model


def compile_wanted(setting: bool | str, device_type: str) -> bool:
    """`compile = "auto"`: on for GPUs, where it pays; off on the CPU, where compile time dominates short runs."""
    if setting == "auto":
        return device_type in ("cuda", "xpu") and _triton_present()
    return bool(setting)


def _triton_present() -> bool:
    from importlib.util import find_spec

    return find_spec("triton") is not None


def _data_parallel(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, precision_name: str,
                   cfg: ParallelConfig, device: torch.device) -> Parallelized:
    # DDP cannot hold DTensor parameters, nor serve two pipeline stages of one rank (its reducer
    # asserts): with tensor or pipeline parallelism, replication too goes through FSDP2, on a
    # (dp_replicate, dp_shard=1) mesh: shards of one rank, gradients all-reduced.
    if dims.dp_shard > 1 or dims.tp > 1 or dims.pp > 1:
        from .fsdp import apply_fsdp, fsdp_grad_sync

        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        model = apply_fsdp(model, block_units(model), dp_mesh, precision_name,
                           cfg.fsdp_reshard_after_forward, cfg.fsdp_cpu_offload)
        return Parallelized(model, grad_sync=fsdp_grad_sync(model))
    if dims.dp_replicate > 1:
        from .ddp import apply_ddp, ddp_grad_sync

        model = apply_ddp(model, mesh["dp_replicate"], device)
        return Parallelized(model, grad_sync=ddp_grad_sync(model))
    return Parallelized(model)


def parallelize(model: nn.Module, *, activation_checkpointing: bool, compile: bool,
                dims: ParallelDims | None = None, mesh: DeviceMesh | None = None, precision_name: str = "fp32",
                cfg: ParallelConfig | None = None, device: torch.device | None = None,
                materialize: Callable | None = None, batch_size: int | None = None) -> Parallelized:
    """Apply, in order: pipeline split, tensor parallelism, activation checkpointing, compile, FSDP or DDP.

    `model` may come on the meta device with `materialize(model, only=names)`, which allocates and
    initialises it: a pipeline rank allocates only the parts it holds (`only=None`: everything).
    `batch_size` (per rank) is checked against the pipeline's micro-batches.
    """
    cfg = cfg or ParallelConfig()
    if dims is not None and dims.pp > 1:
        return _pipeline(model, activation_checkpointing, compile, dims, mesh, precision_name, cfg, device,
                         materialize, batch_size)
    if materialize is not None:
        materialize(model, only=None)
    return _after_split(model, activation_checkpointing, compile, dims, mesh, precision_name, cfg, device)


def _after_split(model: nn.Module, activation_checkpointing: bool, compile: bool, dims: ParallelDims | None,
                 mesh: DeviceMesh | None, precision_name: str, cfg: ParallelConfig,
                 device: torch.device | None) -> Parallelized:
    """Tensor parallelism, activation checkpointing, compile, FSDP or DDP: of the model or of one stage."""
    if dims is not None and dims.tp > 1:
        from .tensor import apply_tp

        apply_tp(model, mesh["tp"], sequence_parallel=cfg.tp_sequence_parallel)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    if dims is None or mesh is None or dims.dp == 1:
        return Parallelized(model)
    return _data_parallel(model, dims, mesh, precision_name, cfg, device or torch.device("cpu"))


def _pipeline(model: nn.Module, activation_checkpointing: bool, compile: bool, dims: ParallelDims, mesh: DeviceMesh,
              precision_name: str, cfg: ParallelConfig, device: torch.device | None, materialize: Callable | None,
              batch_size: int | None) -> Parallelized:
    from .pipeline import pipeline_parallelized, split_model

    device = device or torch.device("cpu")
    split = split_model(model, mesh["pp"].get_local_rank(), cfg, batch_size=batch_size,
                        precision_name=precision_name, materialize=materialize)
    # The rest of the order, for each stage as if it were the model. The rank model keeps the plain
    # names for the optimizer and checkpoints; PipelineStage drives an FSDP stage's gradient syncs.
    parts = [_after_split(stage, activation_checkpointing, compile, dims, mesh, precision_name, cfg, device).model
             for stage in split.stages]
    return pipeline_parallelized(split, parts, mesh["pp"], cfg, device)
