"""Text generation with a KV cache and continuous (iteration-level) batching, for gpudl's GPT.

The worker repeats: admit waiting requests into free cache slots (each prompt prefilled on its
own, causally, which also gives its first token), then one decoding step for every running
sequence at once. A request that arrives mid-generation therefore joins at the next step, and one
that finishes leaves at once and frees its slot (Orca's iteration-level scheduling, as vLLM and
TGI do it). Sampling happens per sequence with its own generator, on the CPU, so a seeded
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
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..data.tokenizer import ByteTokenizer, Tokenizer
from ..errors import UserError
from ..models.gpt import GPT, KVCache
from .detok import TextStream
from .engine import BadInput, DeadlineExceeded, Engine, EngineStopped, Request, call_soon, param_dtype


@dataclass(frozen=True)
class Sampling:
    """How one request is sampled. Checked when made: a bad value raises BadInput naming its field."""

    max_tokens: int = 16               # new tokens at most (>= 1)
    temperature: float = 1.0           # 0: greedy (argmax)
    top_k: int = 0                     # keep the k most likely tokens; 0: all
    top_p: float = 1.0                 # keep the most likely tokens up to this probability mass; 1: all
    stop: tuple[str, ...] = ()         # generation ends when the new text holds one; it is not returned
    seed: int | None = None            # the request's own generator; None: a fresh random seed

    def __post_init__(self):
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise BadInput("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadInput("temperature", f"must be a number >= 0 (0: greedy), got {self.temperature!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise BadInput("top_k", f"must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise BadInput("top_p", f"must be a number in (0, 1] (1: off), got {self.top_p!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise BadInput("stop", f"must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            raise BadInput("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")


class Delta(NamedTuple):
    """One item of a stream: a new token and the text it made certain, or (token None) the end, with
    the text still held back and why it ended: "stop" (a stop text, not included) or "length"."""

    token: int | None
    text: str
    finish: str | None = None


class Completion(NamedTuple):
    """A whole answer: every token made (those of a stop text too: they were generated), its text, why it ended."""

    ids: list[int]
    text: str
    finish: str


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from logits (V,) in fp32 on the CPU: argmax at temperature 0, else temperature,
    then top-k, then top-p (nucleus), then a draw from `generator`."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)  # (V,)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        # Keep a token while the mass of the more likely ones is below top_p: the smallest such set (>= 1 token).
        sorted_p[(sorted_p.cumsum(0) - sorted_p) >= sampling.top_p] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


class _Generate(Request):
    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float | None, prompt: list[int], sampling: Sampling):
        super().__init__(loop, deadline)
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

    Up to `max_batch_size` sequences run at once (each holds a KV cache slot); up to `max_queue`
    more wait. Tokens are streamed as they are made, with their text as `tokenizer` (bytes by
    default) decodes it; only tokens it knows are drawn (a model's vocabulary may be padded past it).
    """

    def __init__(self, model: GPT, device: torch.device | str, *, tokenizer: Tokenizer | None = None,
                 max_batch_size: int = 16, max_queue: int = 256, dtype: torch.dtype | None = None):
        super().__init__(model, device, max_batch_size, max_queue)
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

    def stream(self, prompt_ids: list[int], sampling: Sampling,
               deadline: float | None = None) -> AsyncIterator[Delta]:
        """Queue a request now (BadInput, QueueFull, EngineStopped are raised here, before any token)
        and return its items: Delta(token, text) per token as made, then Delta(None, text, "stop" | "length").

        Call from a coroutine (the items arrive on the running event loop).
        """
        self._check(prompt_ids, sampling)
        request = _Generate(asyncio.get_running_loop(), deadline, list(prompt_ids), sampling)
        self._submit(request)
        return _Stream(request)

    def generate(self, prompt_ids: list[int], sampling: Sampling, deadline: float | None = None) -> AsyncIterator[int]:
        """The new token ids as they are made (queued now, as `stream`)."""
        items = self.stream(prompt_ids, sampling, deadline)

        async def tokens():
            async for item in items:
                if item.token is not None:
                    yield item.token
        return tokens()

    async def complete(self, prompt_ids: list[int], sampling: Sampling, deadline: float | None = None) -> Completion:
        """The whole answer: the same tokens and text as `stream` gives piece by piece."""
        ids, pieces, finish = [], [], "length"
        async for item in self.stream(prompt_ids, sampling, deadline):
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

    def _run(self) -> None:
        while True:
            self._admit()
            if self._abort:
                for seq in self._running:
                    self._answer(seq.request, error=EngineStopped("the engine stopped before this request finished"))
                self._running = []
                return
            if not self._running:
                with self._cond:
                    if not self._pending:
                        if self._finished():
                            return
                        self._cond.wait()
                continue
            self._step()

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, one prompt at a time (causal, no padding)."""
        while len(self._running) < self.max_batch_size:
            with self._cond:
                if not self._pending or self._abort:
                    return
                request = self._pending.popleft()
            if request.cancelled:
                continue
            if request.expired(time.monotonic()):
                self._answer(request, error=DeadlineExceeded(
                    f"waited {time.monotonic() - request.arrived:.3f} s in the queue, past its deadline: "
                    f"retry, or allow more time"))
                continue
            seq, slot = _Sequence(request, self.tokenizer), len(self._running)
            ids = torch.tensor([request.prompt], device=self.device)  # (1, P)
            try:
                logits = self.model.prefill(ids, self.cache, slot).float().cpu()  # (1, V)
            except Exception as e:  # this prompt failed (out of memory, say): the running ones go on
                self._answer(request, error=e)
                continue
            self._advance(seq, logits[0])
            self._flush()  # the first token at once: time to first token is one prefill
            if seq.finish is None:
                self._running.append(seq)

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
        for item in ([error] if error is not None else items):
            request.queue.put_nowait(item)


class _Stream:
    """The async iterator `GenerationEngine.stream` returns; leaving it early cancels the request."""

    def __init__(self, request: _Generate):
        self.request, self.done = request, False

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
        """Stop generating for this request (the worker drops it at its next step)."""
        if not self.done:
            self.request.cancelled, self.done = True, True

    async def aclose(self) -> None:
        self.close()

    def __del__(self):
        self.close()
