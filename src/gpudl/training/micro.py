"""A step's data in micro-batches, and what happens when one does not fit in memory.

The loader draws a step's data (`Job.draws` batches: a recipe draws one of `batch_size x
grad_accum` rows, `fit` with an iterable draws `grad_accum` of the iterable's batches); the loop
cuts it into micro-batches of at most `micro_batch` rows, as views. So how a step is cut never
changes what it trains on: halving the micro-batch (the planner's choice, or out-of-memory
recovery) doubles the accumulation and leaves the samples, the loss and the gradients the same
up to rounding.

Out of memory is recognised by type: torch's `OutOfMemoryError` (CUDA, XPU, and gpudl's CPU
memory limit), or the CPU allocator's failure, a plain RuntimeError that only its text tells apart.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..data.loader import map_tensors
from ..device.accel import empty_cache

_CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: not enough memory"


def rows(batch) -> int:
    """Samples in `batch`: the length of its first tensor with rows (a batch without tensors counts as one).
    Asked a few times a step: it walks the batch only as far as that tensor."""
    found = _first_rows(batch)
    return 1 if found is None else found


def _first_rows(batch) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif not isinstance(batch, (tuple, list)):
        return None
    for item in batch:
        if (found := _first_rows(item)) is not None:
            return found
    return None


def cut(batch, pieces: int) -> list:
    """`batch` in `pieces` parts of (nearly) equal rows, as views; tensors without rows stay whole in each."""
    if pieces == 1:
        return [batch]
    n, splits = rows(batch), {}

    def part(t: torch.Tensor, i: int) -> torch.Tensor:
        if not (t.dim() and t.shape[0] == n):
            return t
        if id(t) not in splits:  # each tensor split once, not once per piece
            splits[id(t)] = t.tensor_split(pieces)
        return splits[id(t)][i]
    return [map_tensors(lambda t, i=i: part(t, i), batch) for i in range(pieces)]


def micro_batches(data: list, micro_batch: int) -> list:
    """The step's data in micro-batches of at most `micro_batch` rows (0: each batch as drawn)."""
    if micro_batch <= 0:
        return data
    return [piece for batch in data for piece in cut(batch, -(-rows(batch) // micro_batch))]


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (type(e) is RuntimeError and _CPU_ALLOCATOR_FAILED in str(e))


@dataclass(frozen=True)
class OutOfMemory:
    """One recovery: the step it happened in, the micro-batch before and after, and torch's message."""

    step: int
    micro_batch: int
    halved_to: int
    error: str

    def record(self) -> dict:
        return {"kind": "oom", "step": self.step, "micro_batch": self.micro_batch, "halved_to": self.halved_to,
                "error": self.error}


def release(device: torch.device) -> None:
    """Return what a failed attempt held (it is unreachable by now) to the device, for the retry."""
    gc.collect()
    empty_cache(device)
