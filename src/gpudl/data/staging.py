"""The host side of the loader: batches made ahead in threads, and reused page-locked staging buffers.

Threads make whole batches, several at once, k = start, start+1, ... handed out in order: where
the work releases the GIL (decoding with Pillow, torch's gathers and resizes) a thread costs no
copy between processes and the batch is already in the training process's memory.

A host-to-device copy can overlap compute only from page-locked memory; pinning each batch anew
costs an allocation and a page lock every step. `PinnedPool` keeps the buffers: a batch is copied
into a free set of the same shapes (in the thread that made it, so the training loop never does
the memcpy), and a set is free again once the device copy that read it has finished.
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

def one_torch_thread() -> None:
    """A loader thread's torch ops run on one core (the setting is the calling thread's own): the
    threads already run side by side, and intra-op threads of their own would crowd the step's cores."""
    torch.set_num_threads(1)


@dataclass
class Staged:
    """A batch in pinned buffers (`handle`: the pool's note of them; None where it was pinned already)."""

    batch: Any
    handle: tuple | None


class ThreadedBatches:
    """make(start), make(start+1), ... from `workers` threads, `workers + 2` batches in flight."""

    def __init__(self, make: Callable[[int], Any], start: int, workers: int):
        self._make, self._next = make, itertools.count(start)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gpudl-batches", initializer=one_torch_thread)
        self._ahead: collections.deque[Future] = collections.deque()
        self._depth = workers + 2
        # Dropped without close() (a loop that ended early): the queued batches are not made at exit.
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

    def __iter__(self) -> ThreadedBatches:
        return self

    def __next__(self) -> Any:
        while len(self._ahead) < self._depth:
            self._ahead.append(self._pool.submit(self._make, next(self._next)))
        return self._ahead.popleft().result()

    def close(self) -> None:
        self._finalizer()


def _strides_kept(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


class PinnedPool:
    """Page-locked buffer sets keyed by the batch's tensor shapes, dtypes and layouts, reused."""

    def __init__(self):
        self._free: dict[tuple, list[tuple[list[torch.Tensor], Any]]] = {}
        self._lock = threading.Lock()

    def stage(self, batch: Any, tensors_in, map_tensors) -> Staged:
        """`batch` copied into a free pinned set (a new one where none is free); already pinned: as it is."""
        tensors = tensors_in(batch)
        if not tensors or all(t.is_pinned() for t in tensors):
            return Staged(batch, None)
        key = tuple((tuple(t.shape), t.dtype, tuple(t.stride()) if _strides_kept(t) else None) for t in tensors)
        buffers = self._take(key) or [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True) if _strides_kept(t)
            else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for b, t in zip(buffers, tensors):
            b.copy_(t)
        it = iter(buffers)
        return Staged(map_tensors(lambda _: next(it), batch), (key, buffers))

    def _take(self, key: tuple) -> list[torch.Tensor] | None:
        with self._lock:
            sets = self._free.get(key)
            if not sets:
                return None
            buffers, copied = sets.pop()
        copied.synchronize()  # the device copy that last read these buffers has finished
        return buffers

    def give_back(self, staged: Staged, copied: Any) -> None:
        """The set behind `staged` is free once the event `copied` (recorded after its copy) completes."""
        if staged.handle is None:
            return
        key, buffers = staged.handle
        with self._lock:
            self._free.setdefault(key, []).append((buffers, copied))
