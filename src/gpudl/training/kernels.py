"""Kernel choices measured per device: causal attention on the CPU kernel measured fastest, SDPA's
flash or math kernel or a composed one (`gpudl.models.attention`).

On the CPU, SDPA takes its flash kernel whenever it can. In bf16 that kernel's backward is
slow at short sequences, and SDPA's math kernel computes in fp32 (casting there and back). A
plain composition -- scaled q times kᵀ, plus a causal mask of -inf, softmax, times v -- stays
in bf16 (the softmax accumulates in fp32 inside), as flash attention's own probabilities do.
At gpt-tiny's shape (batch 32, 4 heads, 128 tokens, head size 32) forward and backward took
34 ms through flash, 19 ms through math and 8 ms composed; a whole bf16 training step 238, 199
and 159 ms. Long sequences are flash's (it does not store the scores): at 1024 tokens it took
220 ms, composed 332 ms. Measured on a 2-core AMD EPYC with torch 2.13; on another CPU or
torch the balance may differ, so gpudl does not hard-code it: for bf16 and fp16 training on
the CPU it times the kernels once per shape, side by side (in a thread of its own, away from
the caller's autocast and checkpointing), keeps the figures in its cache (so that a resumed
run takes the same kernel), and uses the fastest, compiled or not (from torch 2.13; under
torch.compile the composed kernel's ops fuse: a compiled bf16 gpt-tiny step took 160 ms,
against 260 ms on SDPA's own choice). fp32 keeps flash (it won at every shape measured, and
the whole gpt-tiny step was slower composed), accelerators keep SDPA's own choice, and so do
inference and a caller who has chosen kernels already (`torch.nn.attention.sdpa_kernel`).

The choice is the training option `train.attention` ("auto"; "sdpa" keeps SDPA's own choice
everywhere); `build_job` hands the kernel to the model (`models.attention.use_attention`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.torch_version import TorchVersion

from ..models.attention import CPU_KERNELS, Kernel, sdpa
from ..device.discovery import DeviceInfo, cpu_info
from ..device.peak import cached_measurements

T = TypeVar("T")
SCORES_LIMIT = 256 * 2**20  # bytes of fp32 scores beyond which only flash is used (the others store them)
CACHE_FILE = "attention.json"
# Before torch 2.13, dynamo failed (an internal error) on a dynamic shape passed to
# `assume_constant_result`, where 2.13 breaks the graph; there, compiled code keeps SDPA's choice.
CHOICE_TRACEABLE = TorchVersion(torch.__version__) >= "2.13"


def attention_kernel(device: DeviceInfo, setting: str = "auto") -> Kernel:
    """The attention a model should call on `device`: `setting` "sdpa", or "auto" (measured on the CPU)."""
    return measured_cpu_attention if setting == "auto" and device.type == "cpu" else sdpa


def measured_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention on the kernel measured fastest for this shape in training; else SDPA's choice."""
    kernel = _cpu_kernel(q)
    return (CPU_KERNELS[kernel] if kernel else sdpa)(q, k, v, dropout_p)


def _cpu_kernel(q: torch.Tensor) -> str | None:
    """The measured kernel for `q`'s shape in training, or None to leave the choice to SDPA."""
    if (q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16) or q.dim() != 4
            or not torch.is_grad_enabled()  # inference (generation: a new length each token) keeps SDPA's choice
            or (torch.compiler.is_compiling() and not CHOICE_TRACEABLE)):
        return None
    return _kernel_for(q.dtype, tuple(q.shape))


# Under torch.compile the choice is made while tracing and enters the graph as a constant (the
# graph is specialised to the shape anyway). A dynamic shape cannot be passed as a constant: then
# dynamo calls `_measured_kernel` outside the graph (one break), with the real shape.
@torch.compiler.assume_constant_result
def _kernel_for(dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    return _measured_kernel(dtype, shape)


@torch.compiler.disable
def _measured_kernel(dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    if not _default_kernels():
        return None  # the caller chose kernels (`sdpa_kernel`; the FLOP counter does)
    return remembered_choice(dtype, shape, torch.get_num_threads())


@functools.cache  # this process's memory of the cache file: read once per shape
def remembered_choice(dtype: torch.dtype, shape: tuple[int, ...], threads: int) -> str | None:
    return fastest_cpu_kernel(dtype, shape)


def _default_kernels() -> bool:
    # The flags sdpa_kernel sets; they steer the CPU's choice too, despite the module's name.
    return torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def fastest_cpu_kernel(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> str | None:
    """Time forward + backward of each CPU kernel at `shape` (once per machine; cached)."""
    b, h, t, _ = shape
    if b * h * t * t * 4 > SCORES_LIMIT:
        return None  # flash's territory, and stored scores could exhaust memory
    what = f"sdpa|{str(dtype).removeprefix('torch.')}|{'x'.join(map(str, shape))}|causal"
    names = {kernel: f"{what}|{kernel}" for kernel in CPU_KERNELS}
    seconds = cached_measurements(CACHE_FILE, cpu_info(), list(names.values()),
                                  lambda: {names[k]: s for k, s in _time_kernels(dtype, shape).items()})
    return min(CPU_KERNELS, key=lambda kernel: seconds[names[kernel]])


def _time_kernels(dtype: torch.dtype, shape: tuple[int, ...], rounds: int = 4) -> dict[str, float]:
    """Best seconds of forward + backward per kernel over rounds that take turns (the first is warm-up)."""
    return _in_a_clean_thread(lambda: _time_kernels_here(dtype, shape, rounds))


def _time_kernels_here(dtype: torch.dtype, shape: tuple[int, ...], rounds: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)  # a private generator: the run's RNG must not move
    q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3))
    best = dict.fromkeys(CPU_KERNELS, float("inf"))
    for r in range(rounds):
        for name, kernel in CPU_KERNELS.items():
            t0 = time.perf_counter()
            kernel(q, k, v, 0.0).sum().backward()
            if r > 0:
                best[name] = min(best[name], time.perf_counter() - t0)
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
