"""Text generation with a KV cache and continuous (iteration-level) batching, for gpudl's GPT.

The worker repeats: admit waiting requests into free cache slots (the prompts of one length
prefilled in one call, causally, without padding, which also gives their first tokens), then one
decoding step for every running sequence at once. A request that arrives mid-generation therefore joins at the next step, and one
that finishes leaves at once and frees its slot (Orca's iteration-level scheduling, as vLLM and
TGI do it). Free slots go to waiting requests in the fair order (`fair.py`): each client is charged
the tokens its prompts and running sequences cost, so the slots are shared among the clients that
wait. Sampling happens per sequence with its own generator, on the CPU, so a seeded
request draws the same numbers whichever requests share its steps and whichever device runs it.

Prompts come in as token ids; each new token goes out with the text it completes, decoded by the
model's tokenizer (`detok.TextStream`: stop texts are found in that text, whatever the tokenizer).

>>> import asyncio, torch
>>> from gpudl import models
>>> gpt = models.build(models.resolve("gpt-tiny", {"n_layer": 1, "d_model": 16, "n_head": 2}), torch.device("cpu"))
>>> engine = GenerationEngine(gpt, "cpu", max_batch_size=2); engine.start()
>>> done = asyncio.run(engine.complete([72, 105], Sampling(max_tokens=3, temperature=0)))
>>> len(done.ids), done.finish
(3, 'length')
>>> asyncio.run(engine.stop())
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import torch

from ..data.tokenizer import ByteTokenizer, Tokenizer
from ..errors import UserError
from ..models.gpt import GPT, KVCache
from .admission import Mean
from .detok import TextStream
from .engine import BadInput, Engine, EngineStopped, Request, call_soon, param_dtype
from .fair import OUTPUT_WEIGHT, PROMPT_WEIGHT
from .sampling import Completion, Delta, Sampling, sample


class _Generate(Request):
    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float | None, prompt: list[int], sampling: Sampling,
                 client: str, priority: int):
        super().__init__(loop, deadline, client=client, priority=priority)
        self.prompt, self.sampling = prompt, sampling
        self.queue: asyncio.Queue = asyncio.Queue()  # Delta items, or an exception


class _Sequence:
    """A running request, as the worker keeps it: its slot is its index in the running list."""

    def __init__(self, request: _Generate, tokenizer: Tokenizer):
        self.request, self.sampling = request, request.sampling
        self.text = TextStream(tokenizer, request.sampling.stop)
        self.generator = torch.Generator()
        if self.sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.sampling.seed)
        self.ids: list[int] = []      # generated so far
        self.length = len(request.prompt)  # tokens in the cache
        self.finish: str | None = None

    @property
    def last(self) -> int:
        """The newest token: the one the next decoding step feeds (not yet in the cache)."""
        return self.ids[-1]

    def accept(self, token: int, block_size: int) -> list[Delta]:
        """Take a new token; returns what the caller may now see, the end too once it is done."""
        self.ids.append(token)
        items = [Delta(token, self.text.feed(token))]
        if self.text.stopped:
            self.finish = "stop"
        elif len(self.ids) >= self.sampling.max_tokens or self.length + 1 >= block_size:
            self.finish = "length"  # the context or max_tokens is full: release all that was held
        if self.finish is not None:
            items.append(Delta(None, self.text.finish(), self.finish))
        return items


class GenerationEngine(Engine):
    """Generates for many requests at once with gpudl's GPT; requests join and leave between steps.

    Up to `max_batch_size` sequences run at once (each holds a KV cache slot); more wait, as many as
    can start within `max_wait_s` (None: up to `max_queue`). Tokens are streamed as they are made,
    with their text as `tokenizer` (bytes by
    default) decodes it; only tokens it knows are drawn (a model's vocabulary may be padded past it).
    """

    def __init__(self, model: GPT, device: torch.device | str, *, tokenizer: Tokenizer | None = None,
                 max_batch_size: int = 16, max_queue: int = 256, dtype: torch.dtype | None = None,
                 max_wait_s: float | None = None):
        super().__init__(model, device, max_batch_size, max_queue, max_wait_s)
        if not isinstance(model, GPT):
            raise TypeError(f"GenerationEngine runs gpudl's GPT, got {type(model).__name__}")
        self.cfg = model.cfg
        self.tokenizer = tokenizer or ByteTokenizer()
        self.drawn = min(self.tokenizer.vocab_size, self.cfg.vocab_size)  # token ids sampling may choose
        self.dtype = dtype or param_dtype(model)
        try:
            self.cache = KVCache(model.cfg, max_batch_size, self.device, self.dtype)
        except torch.OutOfMemoryError as e:
            raise UserError(f"the KV cache for max_batch_size={max_batch_size} sequences of {self.cfg.block_size} "
                            f"tokens does not fit on {self.device}: lower --max-batch-size") from e
        self._running: list[_Sequence] = []
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # tokens made this step, by their loop
        # A metrics exporter's wrapper around each request's items (metrics.Tracked, on the event loop)
        self.observe_stream: Callable[[AsyncIterator[Delta]], AsyncIterator[Delta]] | None = None
        # self.rate counts generated tokens per second while every slot is taken; over the mean tokens
        # a request gets, requests started per second (what admission needs)
        self._tokens_per_request = Mean()

    def stream(self, prompt_ids: list[int], sampling: Sampling, deadline: float | None = None, *,
               client: str = "", priority: int = 0) -> AsyncIterator[Delta]:
        """Queue a request now (BadInput, Overloaded, EngineStopped are raised here, before any token)
        and return its items: Delta(token, text) per token as made, then Delta(None, text, "stop" | "length").
        `client` and `priority`: whose share of the decode slots it is served from, and its order
        within that share (lower first).

        Call from a coroutine (the items arrive on the running event loop).
        """
        self._check(prompt_ids, sampling)
        request = _Generate(asyncio.get_running_loop(), deadline, list(prompt_ids), sampling, client, priority)
        self._submit(request)
        items = _Stream(request, self)
        return items if self.observe_stream is None else self.observe_stream(items)

    def generate(self, prompt_ids: list[int], sampling: Sampling, deadline: float | None = None, *,
                 client: str = "", priority: int = 0) -> AsyncIterator[int]:
        """The new token ids as they are made (queued now, as `stream`)."""
        items = self.stream(prompt_ids, sampling, deadline, client=client, priority=priority)

        async def tokens():
            async for item in items:
                if item.token is not None:
                    yield item.token
        return tokens()

    async def complete(self, prompt_ids: list[int], sampling: Sampling, deadline: float | None = None, *,
                       client: str = "", priority: int = 0) -> Completion:
        """The whole answer: the same tokens and text as `stream` gives piece by piece."""
        ids, pieces, finish = [], [], "length"
        async for item in self.stream(prompt_ids, sampling, deadline, client=client, priority=priority):
            if item.token is not None:
                ids.append(item.token)
            pieces.append(item.text)
            finish = item.finish or finish
        return Completion(ids, "".join(pieces), finish)

    def _check(self, prompt_ids, sampling) -> None:
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling, got {type(sampling).__name__}")
        vocab, block = self.cfg.vocab_size, self.cfg.block_size
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise BadInput("prompt", "is empty: send at least one token")
        if not all(type(t) is int and 0 <= t < vocab for t in prompt_ids):
            raise BadInput("prompt", f"token ids must be integers in [0, {vocab}) for this model")
        if len(prompt_ids) >= block:
            raise BadInput("prompt", f"{len(prompt_ids)} tokens leave no room for a new one in this model's "
                                     f"context of {block}: send at most {block - 1}")

    def _per_s(self) -> float | None:
        tokens_per_s, per_request = self.rate.per_s, self._tokens_per_request.value
        return None if tokens_per_s is None or not per_request else tokens_per_s / per_request

    def _free_units(self) -> int:
        return self.max_batch_size - len(self._running)

    def requests_running(self) -> int:
        return len(self._running)

    def kv_cache_usage(self) -> float:
        """The KV cache's slots in use, 0 to 1 (vLLM's kv_cache_usage_perc): a slot holds room for a whole
        context from the moment its sequence starts, so this is the share of the cache's memory taken."""
        return len(self._running) / self.max_batch_size

    def _run(self) -> None:
        while True:
            began, made = time.perf_counter(), self.stats.tokens
            self._admit()
            if self._abort:
                for seq in self._running:
                    self._answer(seq.request, error=EngineStopped("the engine stopped before this request finished"))
                self._running = []
                return
            if not self._running:
                with self._cond:
                    if not self._queue:
                        if self._finished():
                            return
                        self._cond.wait()
                continue
            full = len(self._running) == self.max_batch_size
            self._step()
            if full:  # every slot taken, no idle time: tokens per second as the engine can make them
                self.rate.record(self.stats.tokens - made, time.perf_counter() - began)

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, in the fair order. Prompts of one length share a
        call (causal, no padding): a cohort of new requests costs about one prefill, not one each
        (16 prompts of 12 tokens: 4 ms in one call against 20 ms one by one on a CPU core)."""
        while len(self._running) < self.max_batch_size:
            taken = self._take(self.max_batch_size - len(self._running))
            if not taken:
                return
            by_length: dict[int, list[_Generate]] = {}
            for request in taken:
                self._note_start(request)
                by_length.setdefault(len(request.prompt), []).append(request)
            for group in by_length.values():
                self._prefill(group)

    def _take(self, free: int) -> list[_Generate]:
        """Up to `free` waiting requests, in the fair order, each charged to its client as it is taken."""
        taken = []
        with self._cond:
            while len(taken) < free and self._queue and not self._abort:
                request = self._queue.pop()
                if self._gone(request, time.monotonic()):
                    continue
                self._queue.charge(request.client, PROMPT_WEIGHT * len(request.prompt) + OUTPUT_WEIGHT)
                taken.append(request)
        return taken

    def _prefill(self, requests: list[_Generate]) -> None:
        """Prefill prompts of one length into the next free slots; each gets its first token at once."""
        slot, seqs = len(self._running), [_Sequence(r, self.tokenizer) for r in requests]
        ids = torch.tensor([r.prompt for r in requests], device=self.device)  # (B, P)
        try:
            logits = self.model.prefill(ids, self.cache, slot).float().cpu()  # (B, V)
        except Exception as e:  # out of memory, say: one at a time may fit; the running ones go on
            if len(requests) > 1:
                for request in requests:
                    self._prefill([request])
                return
            self._answer(requests[0], error=e)
            return
        for seq, row in zip(seqs, logits):
            self._advance(seq, row)
        self._flush()  # the first tokens at once: time to first token is one prefill
        for i, seq in enumerate(seqs):
            if seq.finish is None:
                if slot + i != len(self._running):  # one before it ended at its first token: close the gap
                    self.cache.move(slot + i, len(self._running), seq.length)
                self._running.append(seq)
            elif seq.finish == "cancelled":
                with self._cond:
                    self.stats.cancelled += 1

    def _step(self) -> None:
        """One new token for every running sequence; the finished ones leave their slots."""
        running = self._running
        tokens = torch.tensor([s.last for s in running], device=self.device)  # (N,)
        pos = torch.tensor([s.length for s in running], device=self.device)  # (N,)
        try:
            logits = self.model.decode(tokens, pos, self.cache).float().cpu()  # (N, V)
        except Exception as e:
            for s in running:
                self._answer(s.request, error=e)
            self._running = []
            return
        self._note_batch(len(running))  # GPT's batch size: sequences per decoding step (prefills run alone)
        for i, s in enumerate(running):
            s.length += 1
            self._advance(s, logits[i])
        self._flush()
        with self._cond:  # each client's service this step (VTC), and the streams whose caller left
            for s in running:
                self._queue.charge(s.request.client, OUTPUT_WEIGHT)
            self.stats.cancelled += sum(s.finish == "cancelled" for s in running)
        for i in reversed(range(len(running))):
            if running[i].finish is not None or running[i].request.cancelled:
                self._leave(i)

    def _leave(self, i: int) -> None:
        """Free slot i by moving the last running sequence into it (slots stay 0..N-1)."""
        last = len(self._running) - 1
        if i != last:
            self.cache.move(last, i, self._running[last].length)
            self._running[i] = self._running[last]
        self._running.pop()

    def _advance(self, seq: _Sequence, logits: torch.Tensor) -> None:
        """Sample seq's next token from logits (V,) and hand the caller what it may now see."""
        if seq.request.cancelled:
            seq.finish = "cancelled"
            return
        items = seq.accept(sample(logits[:self.drawn], seq.sampling, seq.generator), self.cfg.block_size)
        self.stats.tokens += 1
        if seq.finish is not None:
            self._tokens_per_request.add(len(seq.ids))
            self._answer(seq.request, items)
        else:
            self._outbox.setdefault(seq.request.loop, []).append((seq.request, items))

    def _flush(self) -> None:
        """Hand the tokens of this step to their event loops: one wake-up per loop, not one per sequence
        (at 16 streams, a wake-up per token cost the event loop more than parsing the requests)."""
        for loop, deliveries in self._outbox.items():
            call_soon(loop, self._deliver, deliveries)
        self._outbox = {}

    def _deliver(self, deliveries) -> None:
        for request, items in deliveries:
            self._settle(request, items, None)

    def _settle(self, request: _Generate, items, error) -> None:
        self._disarm(request)
        for item in ([error] if error is not None else items):
            request.queue.put_nowait(item)


class _Stream:
    """The async iterator `GenerationEngine.stream` returns; leaving it early cancels the request."""

    def __init__(self, request: _Generate, engine: GenerationEngine):
        self.request, self.engine, self.done = request, engine, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        try:
            item = await self.request.queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finish is not None
        return item

    def close(self) -> None:
        """Stop generating for this request: out of the queue now if it waits, else the worker drops
        it at its next step."""
        if not self.done:
            self.done = True
            self.engine._withdraw(self.request)

    async def aclose(self) -> None:
        self.close()

    def __del__(self):
        self.close()
