"""Data parallelism by replication: torch's DistributedDataParallel over the data-parallel ranks."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ..device.accel import is_accelerator


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> DistributedDataParallel:
    """Wrap `model`; gradients are averaged over `dp_mesh` in buckets during backward."""
    return DistributedDataParallel(
        model, device_ids=[device] if is_accelerator(device) else None,
        process_group=dp_mesh.get_group(), gradient_as_bucket_view=True)


def ddp_grad_sync(model: DistributedDataParallel):
    """Context for a micro-batch: no all-reduce except on the last micro-batch of a step."""
    return lambda last: nullcontext() if last else model.no_sync()
