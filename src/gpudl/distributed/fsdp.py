"""Data parallelism by sharding: FSDP2 `fully_shard`, per block and then the root (HSDP on a 2-D mesh)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def mixed_precision_policy(precision_name: str) -> MixedPrecisionPolicy:
    """Gather parameters in the compute dtype; reduce gradients in fp32 (bf16 sums lose bits). fp8 is
    bf16-mixed here: its float8 linears cast their (gathered bf16) weights themselves, or, with the
    tensorwise recipe, have FSDP gather them in fp8 (`distributed/float8.py`)."""
    param = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "fp8": torch.bfloat16}.get(precision_name)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=torch.float32 if param is not None else None)


def apply_fsdp(model: nn.Module, units: list[nn.Module], dp_mesh: DeviceMesh, precision_name: str,
               reshard_after_forward: bool, cpu_offload: bool) -> nn.Module:
    """Shard each unit (a transformer or residual block) and the root over `dp_mesh`.

    A 1-D mesh is FSDP; a 2-D (dp_replicate, dp_shard) mesh is HSDP: sharded within a group,
    replicated across groups.
    """
    for p in model.parameters():
        if not p.is_contiguous():
            # FSDP2 shards contiguous parameters only: channels-last convolution weights (ResNet) go back to
            # the default layout here, at some speed on the CPU, rather than failing. In place (`.data`): the
            # parameter objects the optimizer will see stay the same.
            p.data = p.data.contiguous()
    # Pinned host memory makes the copies to an accelerator asynchronous; a CPU-only job has none to pin.
    offload = CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    options = {"mesh": dp_mesh, "mp_policy": mixed_precision_policy(precision_name), "offload_policy": offload}
    for i, unit in enumerate(units):
        # The last unit's parameters are needed again at once by backward: keep them gathered.
        fully_shard(unit, reshard_after_forward=reshard_after_forward and i < len(units) - 1, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    return model


def fsdp_grad_sync(model: nn.Module, every_micro_batch: bool = False):
    """Context for a micro-batch: reduce-scatter gradients only on the last micro-batch of a step, or
    on every one (`every_micro_batch`, with CPU offload: the sharded gradients then add up in host
    memory, where a skipped sync would keep every unsharded gradient on the device)."""

    @contextmanager
    def sync(last: bool):
        model.set_requires_gradient_sync(last or every_micro_batch)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return sync
