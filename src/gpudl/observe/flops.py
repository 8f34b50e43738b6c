"""FLOPs of a training step, counted once with `torch.utils.flop_counter` over one forward +
backward: on the meta device where possible (no memory, no compute, every kernel counted).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ..data.loader import Batch, map_tensors, tensors_in
from ..device.accel import is_accelerator


def count_training_flops(model: nn.Module, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor]) -> int:
    """FLOPs of one forward + backward of `model` on `batch` (any device, meta included).

    `batch` is what `loss_fn` takes: tensors in tuples, lists and dicts, nested.

    Attention runs through the math kernel while counting, so it is counted on every device
    (the counter knows the CUDA flash kernels but not the CPU one). RNG state and gradients
    are left as they were.
    """
    return count_step_flops(model, batch, loss_fn)[0]


def count_step_flops(model: nn.Module, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
                     units: list[nn.Module] = ()) -> tuple[int, int]:
    """(FLOPs of one forward + backward, FLOPs of the forward of `units` within it), counted in one
    pass as `count_training_flops` does. With `units` the model's blocks, the second is what
    activation checkpointing runs again in backward."""
    inside, marks = [0], []

    def enter(module, args):
        marks.append(counter.get_total_flops())

    def leave(module, args, output):
        inside[0] += counter.get_total_flops() - marks.pop()
    hooks = [h for u in units for h in (u.register_forward_pre_hook(enter), u.register_forward_hook(leave))]
    grads = {p: p.grad for p in model.parameters()}
    buffers = {b: b.clone() for b in model.buffers()}  # e.g. BatchNorm statistics a forward updates
    devices = [t.device for t in tensors_in(batch) if is_accelerator(t.device)][:1]
    try:
        with torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda"), \
                sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            loss_fn(model, batch).backward()
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for p, g in grads.items():
                p.grad = g
            for b, saved in buffers.items():
                b.copy_(saved)
    return int(counter.get_total_flops()), int(inside[0])


def meta_batch(batch: Batch) -> Batch:
    """A batch of the same structure, shapes and dtypes on the meta device."""
    return map_tensors(lambda t: torch.empty_like(t, device="meta"), batch)
