"""The one function that prepares a model for training, in one fixed order.

Order (torchtitan's): tensor parallelism -> activation checkpointing -> compile -> FSDP/DDP.
Each step is a plain function; `parallelize` is the only place that knows the order.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import UserError


def checkpoint_units(model: nn.Module) -> list[nn.Module]:
    """The blocks whose activations are recomputed: the model's own list, else its largest ModuleList."""
    if hasattr(model, "activation_checkpoint_units"):
        return list(model.activation_checkpoint_units())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise UserError("train.activation_checkpointing needs a model with a list of blocks (an nn.ModuleList, "
                        "or an activation_checkpoint_units() method): add one or turn it off")
    return list(max(lists, key=len))


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


def parallelize(model: nn.Module, *, activation_checkpointing: bool, compile: bool) -> nn.Module:
    """Apply, in order: activation checkpointing, compile."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    return model


__all__ = ["parallelize", "apply_activation_checkpointing", "apply_compile", "compile_wanted"]
