"""Where a model sits on its device's roofline: measured memory bandwidth and arithmetic intensity.

The roofline model (Williams, Waterman and Patterson, 2009): a kernel that does I FLOPs per
byte it moves can reach at most min(peak FLOP/s, bandwidth x I). The peak comes from the
dense-kernel probe in peak.py, the bandwidth from a copy probe here, both measured on the reader's
machine and cached the same way.

Bytes moved are counted on the meta device (no memory, no compute): the sum of the bytes of
every aten operator's inputs and outputs over one forward + backward. That is an upper bound
on memory traffic (caches, and kernels that torch.compile fuses, move less), so the model's
real intensity is at or right of the point drawn. The optimizer step is not counted.

>>> import torch
>>> x = torch.ones(4, device="meta")
>>> with ByteCounter() as c:
...     _ = x.view(2, 2)  # a view: no traffic
...     _ = x * x         # two inputs of 4 fp32 numbers read, one output written
>>> c.bytes
48
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..device import DeviceInfo, synchronize
from ..observe.flops import meta_batch
from ..models import ModelSpec, build_meta, loss_for
from ..device.peak import cached_measurement

aten = torch.ops.aten
# Operators that create or relabel tensors without reading or writing their elements.
_NO_TRAFFIC = {aten.detach.default, aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
               aten.lift_fresh.default, aten._local_scalar_dense.default}


class ByteCounter(TorchDispatchMode):
    """Sums the bytes of every operator's tensor inputs and outputs; views move nothing."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func not in _NO_TRAFFIC:
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


def bytes_per_step(spec: ModelSpec, batch: tuple[torch.Tensor, ...], dtype: torch.dtype) -> int:
    """Bytes one forward + backward of `spec` moves on `batch` with its tensors in `dtype`.

    Mixed precision is counted as if every floating-point tensor were in the low-precision
    dtype: autocast keeps some in fp32 and adds casts, so for it this is an estimate.
    """
    model = build_meta(spec).to(dtype)
    batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in meta_batch(batch))
    with ByteCounter() as counter:
        loss_for(spec)(model, batch).float().backward()
    return counter.bytes


def probe_copy_bandwidth(device: torch.device, n_bytes: int, min_seconds: float = 0.2) -> float:
    """Best bytes/s of copying an `n_bytes` tensor (each copy reads and writes it: 2 x n_bytes)."""
    src = torch.ones(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    synchronize(device)
    best, spent = 0.0, 0.0
    while spent < min_seconds or best == 0.0:
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        synchronize(device)
        dt = time.perf_counter() - t0
        spent += dt
        best = max(best, 2 * n_bytes * reps / dt)
    return best


def measured_bandwidth(info: DeviceInfo, use_cache: bool = True, refresh: bool = False) -> float:
    """Memory bandwidth of `info`'s device in bytes/s (far larger than its caches), measured once;
    `refresh` measures again and keeps the best figure seen."""
    n = (256 if info.type == "cpu" else 2048) * 2**20
    if info.memory_bytes:
        n = min(n, info.memory_bytes // 8)  # source and copy: a quarter of a small device at most
    return cached_measurement("bandwidth.json", info, "copy", lambda: probe_copy_bandwidth(info.torch_device, n),
                              use_cache, refresh)


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roof over `intensity` FLOP/byte: the lower of the compute and the memory limits."""
    return min(peak_flops, bandwidth * intensity)
