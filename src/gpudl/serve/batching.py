"""Dynamic batching for classifiers: concurrent requests run as one forward, each gets its own rows.

A batch closes when it holds `max_batch_size` rows or `max_queue_delay_ms` after its first
request arrived, whichever comes first (Triton's dynamic batcher). While a batch runs, the next
one fills; when the model is the bottleneck the first waiting request is already older than the
delay, so the next batch starts at once with whatever has come.

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

from .engine import BadInput, DeadlineExceeded, Engine, Request, param_dtype


class _Infer(Request):
    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float | None, x: torch.Tensor):
        super().__init__(loop, deadline)
        self.x = x  # (N, C, H, W)
        self.future: asyncio.Future = loop.create_future()


class BatchingEngine(Engine):
    """Runs a classifier (images (N, C, H, W) -> logits (N, K)), or any model of one batched tensor
    (N, ...) -> (N, ...) given its `input_shape`, on batches gathered from concurrent requests.

    `dtype`: what inputs are cast to on the device (default: the model's parameter dtype).
    `input_shape`: (C, H, W) (or a fit model's shape after N) every request must have; None accepts any, and a batch then joins only
    requests of the first one's shape. `input_name` names the input in BadInput errors.
    """

    def __init__(self, model: nn.Module, device: torch.device | str, *, max_batch_size: int = 32,
                 max_queue_delay_ms: float = 5.0, max_queue: int = 256, dtype: torch.dtype | None = None,
                 input_shape: tuple[int, ...] | None = None, input_name: str = "input"):
        super().__init__(model, device, max_batch_size, max_queue)
        if max_queue_delay_ms < 0:
            raise ValueError(f"max_queue_delay_ms must be >= 0, got {max_queue_delay_ms}")
        self.delay_s = max_queue_delay_ms / 1000
        self.dtype = dtype or param_dtype(model)
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.input_name = input_name
        self._pending_rows = 0

    async def infer(self, x: torch.Tensor, deadline: float | None = None) -> torch.Tensor:
        """Logits (N, K), fp32 on the CPU, for images x (N, C, H, W), fp32 on the CPU.

        `deadline` (time.monotonic()): if it passes before the request runs, DeadlineExceeded and it
        is not run. QueueFull at once when max_queue requests wait already.
        """
        self._check(x)
        request = _Infer(asyncio.get_running_loop(), deadline, x)
        with self._cond:  # rows are counted under the same lock as the queue
            self._submit(request)
            self._pending_rows += len(x)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True  # the caller left: the worker skips it if it has not run yet
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
        while (batch := self._next_batch()) is not None:
            if batch:
                self._forward(batch)

    def _next_batch(self) -> list[_Infer] | None:
        """The next batch to run ([] when all it took had expired or were cancelled); None: end."""
        with self._cond:
            while not self._pending:
                if self._finished():
                    return None
                self._cond.wait()
            if self._abort:
                return None
            close_at = self._pending[0].arrived + self.delay_s
            # Nothing new can come once stopping began: run what is there without waiting.
            while self._pending_rows < self.max_batch_size and self._accepting and not self._abort:
                left = close_at - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._take()

    def _take(self) -> list[_Infer]:
        """Under the lock: requests in arrival order while their rows fit (a request is never split)."""
        batch, rows, now = [], 0, time.monotonic()
        shape = self._pending[0].x.shape[1:]
        while self._pending:
            r = self._pending[0]
            if rows + len(r.x) > self.max_batch_size or r.x.shape[1:] != shape:
                break
            self._pending.popleft()
            self._pending_rows -= len(r.x)
            if r.cancelled:
                continue
            if r.expired(now):
                self._answer(r, error=DeadlineExceeded(
                    f"waited {now - r.arrived:.3f} s in the queue, past its deadline: retry, or allow more time"))
                continue
            batch.append(r)
            rows += len(r.x)
        return batch

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
        if request.future.done():  # cancelled by its caller meanwhile
            return
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)
