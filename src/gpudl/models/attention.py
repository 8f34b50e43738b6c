"""Causal attention through `scaled_dot_product_attention`, on the CPU kernel measured fastest.

On the CPU, SDPA takes its flash kernel whenever it can. In bf16 that kernel's backward is
slow at short sequences: at gpt-tiny's shape (batch 32, 4 heads, 128 tokens, head size 32)
forward and backward took 33 ms through flash and 19 ms through the math kernel, and a
whole bf16 training step 239 ms against 181 ms. From 256 tokens on, flash won again (60
against 74 ms at 16 x 6 x 256 x 64; 3x at 1024 tokens). Measured on a 2-core AMD EPYC with
torch 2.13; on another CPU or torch the balance may differ, so gpudl does not hard-code it:
for bf16 and fp16 on the CPU it times both kernels once per shape, side by side (in a thread
of its own, away from the caller's autocast and checkpointing), keeps the figures in its
cache (so that a resumed run takes the same kernel), and uses the faster. fp32 keeps flash
(it won at every shape measured), accelerators keep SDPA's own choice, and so do inference
and a caller who has chosen kernels already (`torch.nn.attention.sdpa_kernel`).

>>> q = k = v = torch.randn(2, 4, 16, 8)
>>> causal_attention(q, k, v).shape
torch.Size([2, 4, 16, 8])
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..device import cpu_info
from ..peak import cached_measurements

T = TypeVar("T")
CPU_CANDIDATES = (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)
MATH_SCORES_LIMIT = 256 * 2**20  # bytes of fp32 scores beyond which the math kernel is not tried
CACHE_FILE = "attention.json"
_chosen: dict[tuple, SDPBackend | None] = {}  # this process's choices, so the cache file is read once


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q kᵀ / √d + causal mask) v for (batch, heads, tokens, head size) tensors."""
    backend = _cpu_backend(q)
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


def _cpu_backend(q: torch.Tensor) -> SDPBackend | None:
    """The measured kernel for `q`'s shape in training, or None to leave the choice to SDPA."""
    if (q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16) or q.dim() != 4
            or not torch.is_grad_enabled()  # inference (generation: a new length each token) keeps SDPA's choice
            or torch.compiler.is_compiling() or not _default_kernels()):
        return None
    key = (q.dtype, tuple(q.shape), torch.get_num_threads())
    if key not in _chosen:
        _chosen[key] = fastest_cpu_kernel(q.dtype, tuple(q.shape))
    return _chosen[key]


def _default_kernels() -> bool:
    # The flags sdpa_kernel sets; they steer the CPU's choice too, despite the module's name.
    return torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def fastest_cpu_kernel(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> SDPBackend | None:
    """Time forward + backward of each CPU kernel at `shape` (once per machine; cached)."""
    b, h, t, _ = shape
    if b * h * t * t * 4 > MATH_SCORES_LIMIT:
        return None  # flash's territory, and the math kernel's scores could exhaust memory
    what = f"sdpa|{str(dtype).removeprefix('torch.')}|{'x'.join(map(str, shape))}|causal"
    names = {kernel: f"{what}|{kernel.name.lower()}" for kernel in CPU_CANDIDATES}
    seconds = cached_measurements(CACHE_FILE, cpu_info(), list(names.values()),
                                  lambda: {names[k]: s for k, s in _time_kernels(dtype, shape).items()})
    return min(CPU_CANDIDATES, key=lambda kernel: seconds[names[kernel]])


def _time_kernels(dtype: torch.dtype, shape: tuple[int, ...], rounds: int = 4) -> dict[SDPBackend, float]:
    """Best seconds of forward + backward per kernel over rounds that take turns (the first is warm-up)."""
    return _in_a_clean_thread(lambda: _time_kernels_here(dtype, shape, rounds))


def _time_kernels_here(dtype: torch.dtype, shape: tuple[int, ...], rounds: int) -> dict[SDPBackend, float]:
    g = torch.Generator().manual_seed(0)  # a private generator: the run's RNG must not move
    q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3))
    best = dict.fromkeys(CPU_CANDIDATES, float("inf"))
    for r in range(rounds):
        for kernel in CPU_CANDIDATES:
            t0 = time.perf_counter()
            with sdpa_kernel(kernel):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            if r > 0:
                best[kernel] = min(best[kernel], time.perf_counter() - t0)
    return best


def _in_a_clean_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a thread of its own, with this thread's number of CPU threads.

    The first forward pass that needs a measurement may run under autocast, no_grad, inference
    mode, activation checkpointing's saved-tensor hooks or a dispatch mode (a FLOP counter):
    all of them are thread-local, so none reaches the probe there.
    """
    threads, out = torch.get_num_threads(), {}

    def target() -> None:
        torch.set_num_threads(threads)
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread below
            out["error"] = e

    worker = threading.Thread(target=target, name="gpudl-attention-probe")
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
