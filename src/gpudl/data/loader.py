"""Feed a batch source to a device, one batch ahead of the training loop.

A batch source is anything with `batch(k) -> tuple[Tensor, ...]`, a pure function of the batch
number k for this data-parallel rank. The loader walks k = start, start+1, ...; resuming is
starting at the position a checkpoint recorded. On CUDA-like devices host batches are pinned
and copied on a side stream with `non_blocking=True`, so the copy of batch k+1 overlaps step k.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

Batch = tuple[torch.Tensor, ...]


class BatchSource(Protocol):
    def batch(self, k: int) -> Batch: ...


class _BatchNumbers(Dataset):
    """dataset[k] is batch k of the source, so DataLoader workers can build batches in parallel."""

    def __init__(self, source: BatchSource):
        self.source = source

    def __getitem__(self, k: int) -> Batch:
        return self.source.batch(k)


class _CountFrom(Sampler):
    def __init__(self, start: int):
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return itertools.count(self.start)


def _host_batches(source: BatchSource, start: int, num_workers: int, pin: bool) -> Iterator[Batch]:
    if num_workers == 0:
        return (source.batch(k) for k in itertools.count(start))
    loader = DataLoader(_BatchNumbers(source), batch_size=None, sampler=_CountFrom(start), num_workers=num_workers,
                        pin_memory=pin, prefetch_factor=4, persistent_workers=False)
    return iter(loader)


class DeviceLoader:
    """Batches start, start+1, ... of `source`, already on `device`.

    `position` counts the batches handed out (what a checkpoint must record);
    `wait_s` is the time the training loop has spent inside the loader.
    """

    def __init__(self, source: BatchSource, device: torch.device, start: int = 0, num_workers: int = 0):
        self.device, self.position, self.wait_s = device, start, 0.0
        self._module = torch.get_device_module(device.type) if device.type in ("cuda", "xpu") else None
        self._stream = self._module.Stream(device) if self._module is not None else None
        self._host = _host_batches(source, start, num_workers, pin=self._stream is not None)
        self._ahead = self._to_device(next(self._host))

    def _to_device(self, batch: Batch) -> Batch:
        if self._stream is None:
            return tuple(t.to(self.device) for t in batch)
        with self._module.stream(self._stream):
            return tuple((t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True) for t in batch)

    def __iter__(self) -> DeviceLoader:
        return self

    def __next__(self) -> Batch:
        t0 = time.perf_counter()
        batch = self._ahead
        if self._stream is not None:
            current = self._module.current_stream(self.device)
            current.wait_stream(self._stream)
            for t in batch:
                t.record_stream(current)  # the side stream's allocation is now used on the main stream
        self._ahead = self._to_device(next(self._host))
        self.position += 1
        self.wait_s += time.perf_counter() - t0
        return batch


def first_batches(source: BatchSource, n: int, device: torch.device) -> Iterator[Batch]:
    """Batches 0..n-1 of a source on `device`: the same evaluation set every time it is asked for."""
    for k in range(n):
        yield tuple(t.to(device) for t in source.batch(k))
