"""A memory limit that is enforced: `limit_memory(device, limit_bytes)`; `train.memory_limit` on a run.

On an accelerator the caching allocator enforces it (`set_per_process_memory_fraction`). On the CPU
no allocator has a limit, so `LiveBytesLimit` counts the bytes of live tensor storages as operators
make them and raises torch's own `OutOfMemoryError` from the operator whose output passes the limit:
the planner, OOM recovery and their tests run the same code on a machine without a GPU.

The CPU count sees every operator run on this thread: the autograd backward (on the CPU it runs on the
calling thread), optimizer kernels, DTensor ops as the local ops they become. It misses buffers a kernel
allocates and frees inside itself (scalars wrapped as tensors: a few bytes) and tensors made on other
threads. It does not combine with torch.compile (`check_compatible`).

>>> from gpudl.device import cpu_info
>>> with limit_memory(cpu_info(), 2**20) as limit:  # doctest: +ELLIPSIS
...     x = torch.zeros(1000)                      # 4000 bytes live
...     y = torch.zeros(2**20)                     # 4 MiB more: refused
Traceback (most recent call last):
torch.OutOfMemoryError: CPU out of memory (gpudl memory limit 1.00 MiB): tried to allocate 4.00 MiB with 3.91 KiB ...
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from ..config.sizes import parse_size
from ..device import DeviceInfo
from ..errors import UserError


def _size(n: int) -> str:
    """Bytes the way CUDA's out-of-memory message writes them: '12.00 MiB'."""
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if abs(n) >= s), ("", 0))
    return f"{n / scale:.2f} {unit}" if scale else f"{n} bytes"


def _check_limit(limit_bytes: int) -> None:
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
        raise UserError(f"memory limit must be a positive number of bytes, got {limit_bytes!r}: e.g. 8GiB")


def check_compatible(compile: bool, device: DeviceInfo) -> None:
    """Refuse a CPU memory limit with torch.compile, in one line (an accelerator's limit is its allocator's).

    Dynamo skips every frame while a Python dispatch mode is active (torch 2.11, 2.13): under the CPU
    limit a compiled model runs eagerly, and that code then stays uncompiled for the whole process.
    """
    if compile and device.type == "cpu":
        raise UserError("a memory limit on the CPU cannot be combined with torch.compile (under the limit's "
                        "count torch.compile runs the model uncompiled): set --set train.compile=false")


class LiveBytesLimit(TorchDispatchMode):
    """Counts live CPU tensor bytes (`live_bytes`, `peak_bytes`); past `limit_bytes`, `torch.OutOfMemoryError`.

    A storage counts from the first operator that returns it as a new tensor (views and in-place results
    add nothing) until it is freed: torch keeps a storage's Python object alive exactly as long as the
    storage, so a weak reference to it subtracts it. What exists before entry counts once `hold`s it.
    """

    def __init__(self, limit_bytes: int, hold=()):
        super().__init__()
        _check_limit(limit_bytes)
        self.limit_bytes, self.live_bytes, self.peak_bytes = limit_bytes, 0, 0
        self._counted: dict[int, tuple[int, weakref.ref]] = {}  # id(storage) -> (bytes, weak ref: its callback)
        self._lock = threading.RLock()                          # frees may come from another thread (gloo's)
        self.hold(hold)  # one object or a tuple of them

    def hold(self, *objs) -> LiveBytesLimit:
        """Count what exists: tensors (in tuples, lists, dicts too), modules (with gradients), optimizers."""
        self._check(sum(self._add(st) for t in _tensors(objs) for st in _storages(t)), "holding existing tensors")
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and any(hasattr(t, "__tensor_flatten__") for t in types):
            return NotImplemented  # a wrapper subclass (DTensor) runs first: its local ops come back here
        out = func(*args, **(kwargs or {}))
        kinds = _return_kinds(func)
        outs = out if len(kinds) > 1 else (out,)
        new = 0
        for t, kind in zip(outs, kinds):
            # A view shares a storage that exists; an in-place or out= result counts only a change in its size.
            for leaf in () if kind == "view" else (t,) if isinstance(t, torch.Tensor) else tree_leaves(t):
                for st in _storages(leaf) if isinstance(leaf, torch.Tensor) else ():
                    new += self._add(st) if kind == "new" or id(st) in self._counted else 0
        try:
            self._check(new, func)
        except torch.OutOfMemoryError:
            out = outs = t = leaf = st = None  # the traceback keeps this frame: free the refused output now
            raise
        return out

    def _add(self, st: torch.UntypedStorage) -> int:
        """Count `st` (or its change in size) and return the bytes added; CPU storages only."""
        if st.device.type != "cpu":
            return 0  # meta and fake tensors (shape propagation) own no memory
        key, n = id(st), st.nbytes()
        with self._lock:
            old, ref = self._counted.get(key) or (0, weakref.ref(st, lambda _, key=key: self._forget(key)))
            self._counted[key] = (n, ref)
            self.live_bytes += n - old
        return n - old

    def _forget(self, key: int) -> None:  # the storage was freed
        with self._lock:
            self.live_bytes -= self._counted.pop(key, (0,))[0]

    def _check(self, new: int, what) -> None:
        # Raised here, held by no local, so no frame-traceback cycle keeps tensors alive until a gc run.
        if self.live_bytes > self.limit_bytes and new > 0:
            raise torch.OutOfMemoryError(
                f"CPU out of memory (gpudl memory limit {_size(self.limit_bytes)}): tried to allocate "
                f"{_size(new)} with {_size(self.live_bytes - new)} already live ({what})")
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __enter__(self):
        # FSDP2 frees and regrows unsharded parameters with UntypedStorage.resize_, which no dispatch
        # mode sees: follow it while active, as torch.distributed._tools.mem_tracker does.
        self._resize = resize = torch.UntypedStorage.resize_

        def tracked_resize(st, size):
            old = st.nbytes()
            resize(st, size)
            try:  # a regrown storage is memory allocated now, counted before or not
                self._check(self._add(st), "UntypedStorage.resize_")
            except torch.OutOfMemoryError:
                resize(st, old)  # as if the allocation had failed
                self._add(st)
                raise
        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


@functools.cache
def _return_kinds(func) -> tuple[str, ...]:
    """Per return of `func`: a new tensor, an in-place or out= result (its storage may be resized), or a view."""
    return tuple("new" if r.alias_info is None else "write" if r.alias_info.is_write else "view"
                 for r in func._schema.returns)


def _tensors(objs):
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            yield from (t for p in obj.parameters() for t in (p, p.grad) if t is not None)
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            yield from (v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (tuple, list, dict)):  # a batch
            yield from _tensors(obj.values() if isinstance(obj, dict) else obj)
        elif obj is not None:
            raise TypeError(f"hold() takes tensors, modules and optimizers, got {type(obj).__name__}")


def _storages(t: torch.Tensor):
    """The storages that hold `t`'s bytes: a wrapper subclass (DTensor) by its inner tensors."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not is_traceable_wrapper_subclass(t):
        return (t.untyped_storage(),)
    names, _ = t.__tensor_flatten__()
    return [st for name in names if isinstance(inner := getattr(t, name), torch.Tensor) for st in _storages(inner)]


@contextlib.contextmanager
def limit_memory(device: DeviceInfo, limit_bytes: int, hold=()):
    """Enforce `limit_bytes` on `device` inside the block; passing it raises `torch.OutOfMemoryError`.

    Yields the `LiveBytesLimit` on the CPU (`hold`: what exists already, e.g. (model, optimizer,
    batch)) and None on an accelerator, whose allocator enforces its memory fraction, restored on exit.
    """
    _check_limit(limit_bytes)
    if device.type == "cpu":
        with LiveBytesLimit(limit_bytes, hold) as limit:
            yield limit
        return
    backend = getattr(torch, device.type, None)
    set_fraction = getattr(backend, "set_per_process_memory_fraction", None)
    if set_fraction is None or not device.memory_bytes:
        raise UserError(f"{device.label} has no way to enforce a memory limit in this torch "
                        f"({torch.__version__}): run without --memory-limit")
    get_fraction = getattr(backend, "get_per_process_memory_fraction", None)
    # MPS: no index, no getter, a fraction of memory_bytes (its recommended working set), default 1.7.
    where = () if device.type == "mps" else (device.index,)
    before = get_fraction(*where) if get_fraction else 1.7 if device.type == "mps" else 1.0
    set_fraction(min(1.0, limit_bytes / device.memory_bytes), *where)
    try:
        yield None
    finally:
        set_fraction(float(before), *where)


@contextlib.contextmanager
def enforce_memory_limit(device: DeviceInfo, text: str, compile: bool = False):
    """`train.memory_limit` ("12GiB"; "" for none) enforced on `device`; yields the CPU's counter, or None."""
    if not text:
        yield None
        return
    check_compatible(compile, device)
    with limit_memory(device, parse_size(text, "train.memory_limit")) as limit:
        yield limit
