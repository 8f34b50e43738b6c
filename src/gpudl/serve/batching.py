"""Dynamic batching for classifiers: concurrent requests run as one forward, each gets its own rows.

A batch closes when it holds `max_batch_size` rows or `max_queue_delay_ms` after its first
request arrived, whichever comes first (Triton's dynamic batcher). While a batch runs, the next
one fills; when the model is the bottleneck the first waiting request is already older than the
delay, so the next batch starts at once with whatever has come. A batch is filled in the fair order
(`fair.py`), each client charged its rows as they are taken, so the rows of a batch are shared among
the clients that wait rather than given to whoever queued most.

>>> import asyncio, torch
>>> engine = BatchingEngine(torch.nn.Flatten(), "cpu", max_batch_size=4); engine.start()
>>> asyncio.run(engine.infer(torch.zeros(2, 1, 2, 2))).shape
torch.Size([2, 4])
>>> asyncio.run(engine.stop())
"""

from __future__ import annotations

import asyncio
import time

import torch
from torch import nn

from .engine import BadInput, Engine, Request, param_dtype


class _Infer(Request):
    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float | None, x: torch.Tensor, client: str,
                 priority: int):
        super().__init__(loop, deadline, client=client, priority=priority, units=len(x))
        self.x = x  # (N, C, H, W)
        self.future: asyncio.Future = loop.create_future()


class BatchingEngine(Engine):
    """Runs a classifier (images (N, C, H, W) -> logits (N, K)), or any model of one batched tensor
    (N, ...) -> (N, ...) given its `input_shape`, on batches gathered from concurrent requests.

    `dtype`: what inputs are cast to on the device (default: the model's parameter dtype).
    `input_shape`: (C, H, W) (or a fit model's shape after N) every request must have; None accepts any, and a batch then joins only
    requests of the first one's shape. `input_name` names the input in BadInput errors.
    `max_wait_s`: admit a request only if its rows can start within this many seconds (None: up to
    `max_queue` requests wait).
    """

    def __init__(self, model: nn.Module, device: torch.device | str, *, max_batch_size: int = 32,
                 max_queue_delay_ms: float = 5.0, max_queue: int = 256, dtype: torch.dtype | None = None,
                 input_shape: tuple[int, ...] | None = None, input_name: str = "input",
                 max_wait_s: float | None = None):
        super().__init__(model, device, max_batch_size, max_queue, max_wait_s)
        if max_queue_delay_ms < 0:
            raise ValueError(f"max_queue_delay_ms must be >= 0, got {max_queue_delay_ms}")
        self.delay_s = max_queue_delay_ms / 1000
        self.dtype = dtype or param_dtype(model)
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.input_name = input_name
        self._busy = False        # a batch is taken and not yet answered (under the lock)
        # The batch being taken was there to take (no idle time in its cycle) and filled it, or left
        # requests waiting: the engine was saturated, so its cycle shows what it can do.
        self._backlogged = False
        self._in_model = 0        # requests in the forward running now (/metrics)

    async def infer(self, x: torch.Tensor, deadline: float | None = None, *, client: str = "",
                    priority: int = 0) -> torch.Tensor:
        """Logits (N, K), fp32 on the CPU, for images x (N, C, H, W), fp32 on the CPU.

        `deadline` (time.monotonic()): if it passes before the request runs, DeadlineExceeded and it
        is not run. Overloaded at once when it could not start within max_wait_s (QueueFull: when
        max_queue requests wait already). `client` and `priority`: whose share it is served from, and
        its order within that share (lower first).
        """
        self._check(x)
        request = _Infer(asyncio.get_running_loop(), deadline, x, client, priority)
        self._submit(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            self._withdraw(request)  # the caller left: out of the queue now, if it has not run yet
            raise

    def _check(self, x) -> None:
        name, n = self.input_name, self.max_batch_size
        if not isinstance(x, torch.Tensor):
            raise BadInput(name, f"expected a tensor, got {type(x).__name__}")
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise BadInput(name, f"expected float32 values on the CPU, got {x.dtype} on {x.device}: send FP32")
        images = self.input_shape is None or len(self.input_shape) == 3
        if images and x.dim() != 4:
            raise BadInput(name, f"expected shape (N, C, H, W), got {list(x.shape)}: send a batch of images")
        if not images and x.dim() != 1 + len(self.input_shape):
            raise BadInput(name, f"expected shape {[-1, *self.input_shape]}, got {list(x.shape)}: send a batch of rows")
        if not 1 <= len(x) <= n:
            raise BadInput(name, f"batch of {len(x)} rows; this server takes 1 to {n} (max_batch_size) per request")
        if self.input_shape is not None and tuple(x.shape[1:]) != self.input_shape:
            want = [-1, *self.input_shape]
            fix = (f"resize the images to {self.input_shape[1]}x{self.input_shape[2]} with {self.input_shape[0]} "
                   f"channels" if images else "send rows of the shape the model was fitted on")
            raise BadInput(name, f"expected shape {want}, got {list(x.shape)}: {fix}")

    def _run(self) -> None:
        cycle_from = time.perf_counter()
        while (batch := self._next_batch()) is not None:
            if batch:
                for r in batch:
                    self._note_start(r)
                self._in_model = len(batch)
                self._forward(batch)
                self._in_model = 0
            now = time.perf_counter()
            if batch and self._backlogged:  # saturated, no idle time in its cycle: what the engine can do
                self.rate.record(sum(r.units for r in batch), now - cycle_from)
            cycle_from = now

    def _next_batch(self) -> list[_Infer] | None:
        """The next batch to run ([] when all it took had expired or were cancelled); None: end."""
        with self._cond:
            self._busy, self._backlogged = False, True
            while not self._queue:
                if self._finished():
                    return None
                self._cond.wait()
                self._backlogged = False
            if self._abort:
                return None
            close_at = min(r.arrived for r in self._queue) + self.delay_s
            # Nothing new can come once stopping began: run what is there without waiting.
            while self._queue.units < self.max_batch_size and self._accepting and not self._abort:
                left = close_at - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
                self._backlogged = False  # it waited for the batch to fill: the engine had room
            return self._take()

    def _take(self) -> list[_Infer]:
        """Under the lock: requests in the fair order while their rows fit (a request is never split)."""
        batch, rows, now = [], 0, time.monotonic()
        shape = self._queue.head().x.shape[1:]
        while (r := self._queue.head()) is not None:
            if rows + r.units > self.max_batch_size or r.x.shape[1:] != shape:
                break
            self._queue.pop()
            if self._gone(r, now):
                continue
            self._queue.charge(r.client, r.units)
            batch.append(r)
            rows += r.units
        self._busy = bool(batch)
        self._backlogged = self._backlogged and (rows == self.max_batch_size or bool(self._queue))
        return batch

    def _free_units(self) -> int:
        return 0 if self._busy else self.max_batch_size

    def requests_running(self) -> int:
        return self._in_model

    def _forward(self, batch: list[_Infer]) -> None:
        x = torch.cat([r.x for r in batch]) if len(batch) > 1 else batch[0].x  # (B, C, H, W)
        try:
            logits = self.model(x.to(self.device, self.dtype)).float().cpu()  # (B, K)
        except Exception as e:  # the model failed (out of memory, say): these requests fail, the engine goes on
            for r in batch:
                self._answer(r, error=e)
            return
        self._note_batch(len(x))
        for r, rows in zip(batch, logits.split([len(r.x) for r in batch])):
            self._answer(r, rows)

    def _settle(self, request: _Infer, result, error) -> None:
        self._disarm(request)
        if request.future.done():  # cancelled by its caller meanwhile
            return
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)
