"""Feed a batch source to a device, one batch ahead of the training loop.

A batch source is anything with `batch(k) -> Batch`, a pure function of the batch number k for
this data-parallel rank. A batch is a tuple of tensors (the recipes' sources), or what a user's
data holds: tensors in tuples, lists and dicts, nested. The loader walks k = start, start+1, ...;
resuming is starting at the position a checkpoint recorded. On CUDA-like devices host batches
are pinned and copied on a side stream with `non_blocking=True`, so the copy of batch k+1
overlaps step k.

A source may split `batch(k)` in two: `wire_batch(k)`, what the host makes and the copy carries,
and `on_device(batch)`, run where the batch arrives (on the copy's side stream): an image source
sends uint8 pixels and normalises them on the device (`images.py`). On the CPU there is no copy
to save: the batch is made whole where batches are made (in the loader's workers, if any).
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..device.accel import overlaps_copies

# Tensors in tuples, lists and dicts, nested; the loop gets a tuple (inputs..., target) or a dict.
Batch = tuple | dict


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """`batch` with `fn` applied to every tensor in it; any other mapping (a Hugging Face
    BatchEncoding, say) becomes a dict, and what is not a tensor (a string, a number) stays."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple keeps its type
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Every tensor in `batch`, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if not isinstance(batch, (tuple, list)):
        return []
    return [t for item in batch for t in tensors_in(item)]


class BatchSource(Protocol):
    def batch(self, k: int) -> Batch: ...


def _halves(source: BatchSource, device: torch.device) -> tuple[Callable[[int], Batch], Callable[[Batch], Batch]]:
    """(what the host makes of batch k, what the device does to it on arrival): the source's wire batch
    and its finish where it has them and the batch travels to an accelerator, else the batch as it is."""
    if device.type == "cpu" or not hasattr(source, "wire_batch"):
        return source.batch, lambda batch: batch
    return source.wire_batch, source.on_device


class _BatchNumbers(Dataset):
    """dataset[k] is what the host makes of batch k, so DataLoader workers can build batches in parallel."""

    def __init__(self, make: Callable[[int], Batch]):
        self.make = make

    def __getitem__(self, k: int) -> Batch:
        return self.make(k)


class _CountFrom(Sampler):
    def __init__(self, start: int):
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return itertools.count(self.start)


def _host_batches(make: Callable[[int], Batch], start: int, num_workers: int, pin: bool) -> Iterator[Batch]:
    if num_workers == 0:
        return (make(k) for k in itertools.count(start))
    loader = DataLoader(_BatchNumbers(make), batch_size=None, sampler=_CountFrom(start), num_workers=num_workers,
                        pin_memory=pin, prefetch_factor=4, persistent_workers=False,
                        worker_init_fn=_leave_signals_to_the_trainer)
    return iter(loader)


def _leave_signals_to_the_trainer(worker_id: int) -> None:
    """Ctrl-C reaches every process of the terminal's group; a loader worker that died of it would
    fail the step the trainer is finishing before it saves (see interrupt.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class DeviceLoader:
    """Batches start, start+1, ... of `source`, already on `device`.

    `position` counts the batches handed out (what a checkpoint must record);
    `wait_s` is the time the training loop has spent inside the loader.
    """

    def __init__(self, source: BatchSource, device: torch.device, start: int = 0, num_workers: int = 0):
        self.device, self.position, self.wait_s = device, start, 0.0
        # Copies from pinned memory on a side stream, so the next batch travels while this step computes.
        self._stream = torch.Stream(device) if overlaps_copies(device) else None
        make, self._finish = _halves(source, device)
        self._host = _host_batches(make, start, num_workers, pin=self._stream is not None)
        self._prefetch()

    def _to_device(self, batch: Batch) -> Batch:
        if self._stream is None:
            return self._finish(map_tensors(lambda t: t.to(self.device), batch))
        with self._stream:
            return self._finish(map_tensors(
                lambda t: (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True), batch))

    def _prefetch(self) -> None:
        """Start on the next batch. An error in making it waits until the loop asks for that batch:
        a run's last batch may be the last one a one-shot iterator has, and nothing needs the next."""
        try:
            self._ahead, self._error = self._to_device(next(self._host)), None
        except Exception as e:
            self._ahead, self._error = None, e

    def __iter__(self) -> DeviceLoader:
        return self

    def __next__(self) -> Batch:
        if self._error is not None:
            raise self._error
        t0 = time.perf_counter()
        batch = self._ahead
        if self._stream is not None:
            current = torch.accelerator.current_stream(self.device)
            current.wait_stream(self._stream)
            for t in tensors_in(batch):
                t.record_stream(current)  # the side stream's allocation is now used on the main stream
        self._prefetch()
        self.position += 1
        self.wait_s += time.perf_counter() - t0
        return batch


def first_batches(source: BatchSource, n: int, device: torch.device) -> Iterator[Batch]:
    """Batches 0..n-1 of a source on `device`: the same evaluation set every time it is asked for."""
    make, finish = _halves(source, device)
    for k in range(n):
        yield finish(map_tensors(lambda t: t.to(device), make(k)))
