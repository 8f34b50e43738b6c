"""The serving engine: requests come in from asyncio, the model runs in one worker thread, answers go back.

No HTTP here: the engines are usable from any Python program that runs an event loop.
`BatchingEngine` (batching.py) answers classifiers with dynamic batching; `GenerationEngine`
(generation.py) generates text with a KV cache and continuous batching. Both share what this
module holds: the errors a caller can get, the queue (fair among clients: `fair.py`; bounded by
what can start within `max_wait_s`: `admission.py`, and by `max_queue`), requests that leave it
before they cost model time (their deadline passed, their caller left), the worker thread's life
(start, a graceful stop that drains what was accepted), counters, and the hand-over of answers to
the event loop that asked.

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
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .admission import Rate, retry_after
from .fair import FairQueue


class EngineError(Exception):
    """Base of what an engine answers instead of a result."""


class Overloaded(EngineError):
    """Refused at once: the request could not start within the engine's target wait (`max_wait_s`).
    `retry_after_s`: about when the queue ahead of it will have drained enough (HTTP 429, Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Overloaded):
    """The queue holds max_queue requests already: try again later (HTTP 429, Retry-After)."""


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
    rejected: int = 0              # refused at once: could not start within max_wait_s, or queue full
    expired: int = 0               # their deadline passed before they ran: dropped from the queue, not run
    cancelled: int = 0             # their caller left before they ran (dropped), or while a stream ran
    failed: int = 0                # the model raised while running them
    tokens: int = 0                # tokens generated (GPT)
    latency_s_total: float = 0.0   # arrival to answer, summed over `requests`
    # rows (classifiers) or sequences (GPT) per model call -> how many calls had that size; bounded
    # by max_batch_size keys, so a long-running server's memory does not grow with it
    batch_sizes: Counter = field(default_factory=Counter)


class Request:
    """What every queued request carries: the loop to answer on, its arrival and deadline, who sent
    it (`client`: an opaque name, a hash of a key or a tenant's name) and its `priority` within
    that client's share (lower first), and its cost in the engine's units (rows, or 1 request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float | None, *, client: str = "",
                 priority: int = 0, units: int = 1):
        self.loop, self.deadline = loop, deadline
        self.client, self.priority, self.units = client, priority, units
        self.arrived = time.monotonic()
        self.cancelled = False  # the caller stopped waiting: drop it, do not run it
        self.started: float | None = None  # when the model took it up (its queue time ends there)
        self.order: tuple[int, int] | None = None        # its place in its client's queue (FairQueue.push)
        self.timer: asyncio.TimerHandle | None = None    # drops it from the queue at its deadline

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline


class Engine:
    """The worker thread, the bounded queue and the counters; subclasses supply `_run`."""

    def __init__(self, model: nn.Module, device: torch.device | str, max_batch_size: int, max_queue: int,
                 max_wait_s: float | None = None):
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError(f"max_batch_size and max_queue must be >= 1, got {max_batch_size} and {max_queue}")
        if max_wait_s is not None and not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0 (None: admit up to max_queue), got {max_wait_s}")
        self.model, self.device = model.eval(), torch.device(device)
        self.max_batch_size, self.max_queue, self.max_wait_s = max_batch_size, max_queue, max_wait_s
        self.stats = Stats()
        self.rate = Rate()  # units started per second while saturated (admission.py); the worker measures it
        # Hooks for a metrics exporter, called from the worker thread: batch size per model call,
        # seconds from arrival to answer per request, seconds from arrival to the model taking it up.
        self.observe_batch: Callable[[int], None] | None = None
        self.observe_latency: Callable[[float], None] | None = None
        self.observe_queue: Callable[[float], None] | None = None
        self._queue = FairQueue()  # guarded by _cond, as are the counters of refused, expired and cancelled
        self._cond = threading.Condition()
        self._accepting = False
        self._abort = False  # stop() ran out of time: fail what is left instead of running it
        self._thread: threading.Thread | None = None

    def queue_depth(self) -> int:
        """Requests waiting for the model now."""
        return len(self._queue)

    def requests_running(self) -> int:
        """Requests the model is working on now (those of the batch in its forward, or the sequences
        holding KV cache slots)."""
        raise NotImplementedError

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
        """Queue a request, or refuse it at once (from the event loop that will await it)."""
        if type(request.priority) is not int or not -2**31 <= request.priority < 2**31:
            raise BadInput("priority", f"must be an integer in [-2**31, 2**31) (lower is served earlier), "
                                       f"got {request.priority!r}")
        with self._cond:
            if not self._accepting:
                raise EngineStopped("the engine is not running (stopping, stopped or not started): "
                                    "send the request to a running server")
            self._refuse_if_overloaded(request)
            self._queue.push(request)
            self._cond.notify_all()
        if request.deadline is not None:  # dropped at its deadline even while the worker is busy
            request.timer = request.loop.call_later(max(request.deadline - time.monotonic(), 0.0),
                                                    self._expire, request)

    def precheck(self, client: str = "", units: int = 1) -> None:
        """Raise Overloaded now if a request of `client` costing `units` could not be admitted: a
        route refuses before it parses a large body (a classifier's JSON costs the cores the model
        runs on); the check at submission, with the request's real cost, still follows."""
        probe = Request(None, None, client=client, units=units)
        with self._cond:
            self._refuse_if_overloaded(probe)

    def _refuse_if_overloaded(self, request: Request) -> None:
        """Under the lock: raise Overloaded unless the request can start within max_wait_s."""
        if len(self._queue) >= self.max_queue:
            self.stats.rejected += 1
            raise QueueFull(f"{len(self._queue)} requests are waiting already (max_queue={self.max_queue}): "
                            f"retry shortly", 1.0)
        if self.max_wait_s is None:
            return
        ahead = self._queue.ahead(request.client, request.units)
        late = retry_after(ahead=ahead, units=request.units, free=self._free_units(), per_s=self._per_s(),
                           max_wait_s=self.max_wait_s, capacity=self.max_batch_size)
        if late is not None:
            self.stats.rejected += 1
            raise Overloaded(f"it could not start within {self.max_wait_s:g} s: {len(self._queue)} requests wait "
                             f"already; retry in {math.ceil(late)} s", late)

    def _per_s(self) -> float | None:
        """Units (rows, or requests) the engine starts per second when saturated; None: not measured yet."""
        return self.rate.per_s

    def _free_units(self) -> int:
        """Units that can start without waiting for the model (free decode slots, an idle batch)."""
        raise NotImplementedError

    def _expire(self, request: Request) -> None:
        """On the request's loop, at its deadline: if it still waits, it leaves the queue unrun."""
        with self._cond:
            if not self._queue.remove(request):
                return  # started (or answered) already: a deadline only bounds the wait
            self.stats.expired += 1
        self._settle(request, None, _late(request, time.monotonic()))

    def _withdraw(self, request: Request) -> None:
        """On the request's loop, when its caller stops waiting: a queued request leaves the queue now
        (a running GPT sequence leaves at the worker's next step)."""
        request.cancelled = True
        self._disarm(request)
        with self._cond:
            if self._queue.remove(request):
                self.stats.cancelled += 1

    def _gone(self, request: Request, now: float) -> bool:
        """Under the lock, for a request just taken from the queue: whether it must not run (its caller
        left, or its deadline passed before its timer fired; then it is answered so)."""
        if request.cancelled:
            self.stats.cancelled += 1
            return True
        if request.expired(now):
            self.stats.expired += 1
            call_soon(request.loop, self._settle, request, None, _late(request, now))
            return True
        return False

    @staticmethod
    def _disarm(request: Request) -> None:
        """On the request's loop: its deadline no longer matters (it started, or it is over)."""
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None

    def _main(self) -> None:
        # inference_mode is per thread: entered here, in the thread that runs the model.
        with torch.inference_mode():
            self._run()
        with self._cond:  # abort: whatever is still queued was never run
            left, self._queue = list(self._queue), FairQueue()
        for r in left:
            self._answer(r, error=EngineStopped("the engine stopped before running this request"))

    def _run(self) -> None:
        raise NotImplementedError

    def _finished(self) -> bool:
        """Under the lock: nothing will come any more and nothing is waiting."""
        return self._abort or (not self._accepting and not self._queue)

    def _note_start(self, request: Request) -> None:
        """From the worker thread: the model takes `request` up now, and its wait ends."""
        request.started = time.monotonic()
        if self.observe_queue is not None:
            self.observe_queue(request.started - request.arrived)

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
        elif not isinstance(error, (DeadlineExceeded, EngineStopped)):
            self.stats.failed += 1
        call_soon(request.loop, self._settle, request, result, error)

    def _settle(self, request: Request, result, error: BaseException | None) -> None:
        """On the request's event loop: deliver the outcome (subclasses know where it goes)."""
        raise NotImplementedError


def _late(request: Request, now: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"waited {now - request.arrived:.3f} s in the queue, past its deadline: retry, or "
                            f"allow more time")


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run fn(*args) on `loop` from another thread; a loop already closed has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def param_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's weights (fp32 for a model without any)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
