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

Workers are threads for a source that says its work releases the GIL (`parallel = "threads"`:
decoding an image folder, gathering images in memory), processes (torch's DataLoader) otherwise;
`data.num_workers="auto"` asks the source how many (`auto_workers`). On an accelerator the host
batches land in reused page-locked buffers (`staging.py`). A source that can live on the device
(`resident_on(device)`: a token set that fits) makes its batches there, with no host work at all.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..device.accel import is_accelerator, overlaps_copies
from .staging import PinnedPool, Staged, ThreadedBatches

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


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and torchrun narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_plan(source: BatchSource, setting: int | str, device: torch.device, cores: int) -> tuple[int, str, str]:
    """(how many workers, "threads" or "processes", why): what `data.num_workers` means for this source."""
    kind = getattr(source, "parallel", "processes")
    if setting == "auto":
        auto = getattr(source, "auto_workers", None)
        n = auto(cores, is_accelerator(device)) if auto else 0
        return n, kind, f"data.num_workers=auto, {cores} usable cores"
    return int(setting), kind, f"data.num_workers={setting}"


def _host_batches(make: Callable[[int], Batch], start: int, workers: int, kind: str, pin: bool) -> Iterator[Batch]:
    if workers == 0:
        return (make(k) for k in itertools.count(start))
    if kind == "threads":
        return ThreadedBatches(make, start, workers)
    loader = DataLoader(_BatchNumbers(make), batch_size=None, sampler=_CountFrom(start), num_workers=workers,
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
    `wait_s` is the time the training loop has spent inside the loader;
    `description` says how the batches are made (the run's start block prints it).
    """

    def __init__(self, source: BatchSource, device: torch.device, start: int = 0, num_workers: int | str = 0,
                 cores: int = 1):
        self.device, self.position, self.wait_s = device, start, 0.0
        source = for_device(source, device)
        resident = getattr(source, "resident_on", None)
        on_device = resident(device) if resident is not None and device.type != "cpu" else None
        source, workers, kind, why = (on_device, 0, "threads", "drawn on the device") if on_device is not None \
            else (source, *worker_plan(source, num_workers, device, cores))
        decoding = getattr(source, "decoding", None)
        self.workers = workers
        self.description = _describe(workers, kind, why) + (f"; images decoded {decoding}" if decoding else "")
        self.bad_images = getattr(source, "bad", None)  # the files a decoding source skipped, where it has them
        # Copies from pinned memory on a side stream, so the next batch travels while this step computes.
        self._stream = torch.Stream(device) if overlaps_copies(device) and on_device is None else None
        make, self._finish = _halves(source, device)
        # Staged where the batch is made, so the training loop does no memcpy; worker processes
        # cannot touch the device's pinned memory: torch's DataLoader pins their batches itself.
        self._pinned = PinnedPool() if self._stream is not None and (workers == 0 or kind == "threads") else None
        if self._pinned is not None:
            make = self._staging(make)
        self._host = _host_batches(make, start, workers, kind, pin=self._stream is not None)
        self._prefetch()

    def _staging(self, make: Callable[[int], Batch]) -> Callable[[int], Batch]:
        def staged(k: int):
            return self._pinned.stage(make(k), tensors_in, map_tensors)
        return staged

    def _to_device(self, made: Batch | Staged) -> Batch:
        if self._stream is None:
            return self._finish(map_tensors(lambda t: t.to(self.device), made))
        batch = made.batch if isinstance(made, Staged) else made
        with self._stream:
            moved = map_tensors(lambda t: (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True),
                                batch)
            if isinstance(made, Staged):
                copied = torch.Event()
                copied.record(self._stream)
                self._pinned.give_back(made, copied)
            return self._finish(moved)

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

    def close(self) -> None:
        """Stop making batches ahead (threads); what is in flight is dropped."""
        close = getattr(self._host, "close", None)
        if close is not None:
            close()


def _describe(workers: int, kind: str, why: str) -> str:
    if why == "drawn on the device":
        return "batches drawn on the device (the data set lives there)"
    if workers == 0:
        return f"batches made in the training process ({why})"
    unit = ("thread", "threads") if kind == "threads" else ("worker process", "worker processes")
    return f"{workers} {unit[workers > 1]} making batches ahead ({why})"


def for_device(source: BatchSource, device: torch.device) -> BatchSource:
    """The source as `device` takes it best, where it says (an image folder decoding on the GPU)."""
    shaped = getattr(source, "for_device", None)
    return shaped(device) if shaped is not None else source


def first_batches(source: BatchSource, n: int, device: torch.device) -> Iterator[Batch]:
    """Batches 0..n-1 of a source on `device`: the same evaluation set every time it is asked for."""
    make, finish = _halves(for_device(source, device), device)
    for k in range(n):
        yield finish(map_tensors(lambda t: t.to(device), make(k)))
