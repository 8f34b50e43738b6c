"""The serving engine: requests come in from asyncio, the model runs in one worker thread, answers go back.

No HTTP here: the engines are usable from any Python program that runs an event loop.
`BatchingEngine` (batching.py) answers classifiers with dynamic batching; `GenerationEngine`
(generation.py) generates text with a KV cache and continuous batching. Both share what this
module holds: the errors a caller can get, a bounded queue, the worker thread's life (start, a
graceful stop that drains what was accepted), counters, and the hand-over of answers to the event
loop that asked.

One worker thread per engine: the model runs on one device, and torch releases the GIL inside
its kernels, so the event loop keeps parsing and answering requests while a batch runs.

>>> import asyncio, torch
>>> from gpudl.serve.batching import BatchingEngine
>>> engine = BatchingEngine(torch.nn.Flatten(), torch.device("cpu")); engine.start()
>>> asyncio.run(engine.infer(torch.ones(1, 1, 2, 2))).shape
torch.Size([1, 4])
>>> asyncio.run(engine.stop())
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


class EngineError(Exception):
    """Base of what an engine answers instead of a result."""


class QueueFull(EngineError):
    """The queue holds max_queue requests already: try again later (HTTP 503)."""


class DeadlineExceeded(EngineError):
    """The request's deadline passed before the model ran it; it was not run (HTTP 504)."""


class EngineStopped(EngineError):
    """The engine is stopping or stopped and takes no new requests (HTTP 503)."""


class BadInput(EngineError):
    """A request the engine cannot run as sent; `field` names what is wrong (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass
class Stats:
    """Counters of one engine, updated by its worker thread (reads from elsewhere may be a step old)."""

    requests: int = 0              # answered with a result
    rejected: int = 0              # refused at once: queue full
    expired: int = 0               # their deadline passed before they ran
    failed: int = 0                # the model raised while running them
    tokens: int = 0                # tokens generated (GPT)
    latency_s_total: float = 0.0   # arrival to answer, summed over `requests`
    # rows (classifiers) or sequences (GPT) per model call -> how many calls had that size; bounded
    # by max_batch_size keys, so a long-running server's memory does not grow with it
    batch_sizes: Counter = field(default_factory=Counter)


class Request:
    """What every queued request carries: the loop to answer on, its arrival and deadline."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float | None):
        self.loop, self.deadline = loop, deadline
        self.arrived = time.monotonic()
        self.cancelled = False  # the caller stopped waiting: drop it, do not run it

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline


class Engine:
    """The worker thread, the bounded queue and the counters; subclasses supply `_run`."""

    def __init__(self, model: nn.Module, device: torch.device | str, max_batch_size: int, max_queue: int):
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError(f"max_batch_size and max_queue must be >= 1, got {max_batch_size} and {max_queue}")
        self.model, self.device = model.eval(), torch.device(device)
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.stats = Stats()
        # Hooks for a metrics exporter, called from the worker thread: batch size per model call,
        # seconds from arrival to answer per request.
        self.observe_batch: Callable[[int], None] | None = None
        self.observe_latency: Callable[[float], None] | None = None
        self._pending: deque[Request] = deque()
        self._cond = threading.Condition()
        self._accepting = False
        self._abort = False  # stop() ran out of time: fail what is left instead of running it
        self._thread: threading.Thread | None = None

    def queue_depth(self) -> int:
        """Requests waiting for the model now."""
        return len(self._pending)

    def start(self) -> None:
        """Start the worker thread; requests are accepted from now on."""
        if self._thread is not None:
            raise RuntimeError("the engine was started already; make a new one to start again")
        self._accepting = True
        self._thread = threading.Thread(target=self._main, name=f"gpudl-{type(self).__name__}", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Take no new requests, answer those already accepted, then end the worker thread.

        What is still unanswered after `timeout_s` seconds gets EngineStopped.
        """
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        if self._thread is None:
            return
        await asyncio.to_thread(self._thread.join, max(timeout_s, 0.0))
        if self._thread.is_alive():
            with self._cond:
                self._abort = True
                self._cond.notify_all()
            await asyncio.to_thread(self._thread.join)

    def _submit(self, request: Request) -> None:
        with self._cond:
            if not self._accepting:
                raise EngineStopped("the engine is not running (stopping, stopped or not started): "
                                    "send the request to a running server")
            if len(self._pending) >= self.max_queue:
                self.stats.rejected += 1
                raise QueueFull(f"{len(self._pending)} requests are waiting already (max_queue={self.max_queue}): "
                                f"retry shortly")
            self._pending.append(request)
            self._cond.notify_all()

    def _main(self) -> None:
        # inference_mode is per thread: entered here, in the thread that runs the model.
        with torch.inference_mode():
            self._run()
        with self._cond:  # abort: whatever is still queued was never run
            left, self._pending = list(self._pending), deque()
        for r in left:
            self._answer(r, error=EngineStopped("the engine stopped before running this request"))

    def _run(self) -> None:
        raise NotImplementedError

    def _finished(self) -> bool:
        """Under the lock: nothing will come any more and nothing is waiting."""
        return self._abort or (not self._accepting and not self._pending)

    def _note_batch(self, size: int) -> None:
        self.stats.batch_sizes[size] += 1
        if self.observe_batch is not None:
            self.observe_batch(size)

    def _answer(self, request: Request, result=None, error: BaseException | None = None) -> None:
        """Count the outcome and hand it to the request's own event loop (from the worker thread)."""
        if error is None:
            latency = time.monotonic() - request.arrived
            self.stats.requests += 1
            self.stats.latency_s_total += latency
            if self.observe_latency is not None:
                self.observe_latency(latency)
        elif isinstance(error, DeadlineExceeded):
            self.stats.expired += 1
        elif not isinstance(error, EngineStopped):
            self.stats.failed += 1
        call_soon(request.loop, self._settle, request, result, error)

    def _settle(self, request: Request, result, error: BaseException | None) -> None:
        """On the request's event loop: deliver the outcome (subclasses know where it goes)."""
        raise NotImplementedError


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run fn(*args) on `loop` from another thread; a loop already closed has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def param_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's weights (fp32 for a model without any)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
