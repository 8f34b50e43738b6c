"""How many CPU threads the model gets when a server runs it on the CPU.

A server's model shares the CPU with its event loop (HTTP parsing, JSON, tokenising) and often
with its clients. torch's intra-op pool is an OpenMP team: at the end of every kernel each thread
waits at a barrier for the others, so when the event loop takes a core from one of them, the whole
kernel waits a scheduler time slice (about a millisecond). For long kernels that is noise; for a
GPT's decoding step, whose kernels last tens of microseconds, it multiplies the step's time.
Measured on 2 cores (benchmarks/serve_load.py, 16 clients, gpudl serve with batching): gpt-tiny
5,585 tokens/s with 1 thread, 2,310 with torch's default of 2; ResNet-18 at 32 px the other way
round, 107 images/s with 2 threads and 82 with 1, its convolutions lasting milliseconds each.

So the server times one full-size call (the batch the engine runs at most) and counts its kernels.
When they average under `SHORT_KERNEL_S`, one core stays free for the event loop; within that cap
it takes the fewest threads (1, 2, 4, ...) within `TOLERANCE` of the fastest, since a thread that
buys less than that is worth more to the event loop and the clients. `gpudl serve --threads N`
overrides all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

TOLERANCE = 0.10        # a thread count within 10% of the fastest is as good, and leaves cores free
SHORT_KERNEL_S = 1e-3   # kernels shorter than a scheduler time slice on average: keep a core free


def candidates(cores: int) -> list[int]:
    """1, 2, 4, ... below `cores`, and `cores` itself."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [max(cores, 1)]


def seconds_per_call(call: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls, after one untimed (the first allocates and warms caches)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def kernels_per_call(call: Callable[[], object]) -> int:
    """How many aten operators one call runs (each a parallel region at most)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        call()
    return max(Count.n, 1)


def choose_threads(call: Callable[[], object], cores: int, tolerance: float = TOLERANCE) -> tuple[int, dict[int, float]]:
    """Time `call` at each candidate thread count; the fewest threads within `tolerance` of the
    fastest, with one core left free when the call's kernels are short, and every count's
    seconds. Leaves torch set to the chosen count."""
    torch.set_num_threads(1)
    timings = {1: seconds_per_call(call)}
    if timings[1] / kernels_per_call(call) < SHORT_KERNEL_S:
        cores -= 1  # the event loop's core
    for n in candidates(cores)[1:]:
        torch.set_num_threads(n)
        timings[n] = seconds_per_call(call)
    fastest = min(timings.values())
    chosen = min(n for n, s in timings.items() if s <= fastest * (1 + tolerance))
    torch.set_num_threads(chosen)
    return chosen, timings


def full_batch_call(loaded, max_batch_size: int, cache=None) -> Callable[[], object]:
    """One call of the size the engine runs at most: a decoding step of `max_batch_size` sequences
    half-way through their context (GPT), or a forward of `max_batch_size` inputs (classifier).

    `cache`: the engine's own KV cache, used before the engine starts (a second one could double a
    large model's memory); what the call writes there is masked until a prompt overwrites it.
    """
    model, device, dtype = loaded.model, loaded.device, loaded.dtype
    if loaded.kind == "gpt":
        from ..models.gpt import KVCache

        cache = cache if cache is not None else KVCache(model.cfg, max_batch_size, device, dtype)
        tokens = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        pos = torch.full((max_batch_size,), model.cfg.block_size // 2, device=device)
        return lambda: _inference(model.decode, tokens, pos, cache)
    x = torch.zeros(max_batch_size, *loaded.input_shape, dtype=dtype, device=device)
    return lambda: _inference(model, x)


def _inference(fn, *args):
    with torch.inference_mode():
        return fn(*args)
