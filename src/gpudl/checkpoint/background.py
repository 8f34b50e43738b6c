"""Checkpoints written while training goes on (`checkpoint.async`).

At the step boundary the state (model, optimizer, RNG) is copied into host buffers that are
allocated at the first save and reused by every later one (pinned where the device is an
accelerator; FSDP's DTensors as their local shards); a thread then runs DCP's save of that copy,
on a Gloo group of its own when there is a process group, so its collectives never meet
training's. Rank 0 writes state.json and the manifest and renames `.tmp` into place only after
DCP's save returned, which is after every rank wrote its shards: a crash or SIGKILL during the
write leaves the previous checkpoint the newest. One save at a time: the next save, a stop and
the end of the run wait for the one in flight.

A write that failed (a full disk) raises the same one-line UserError as a synchronous save. One
process raises it at the first step boundary after it failed; several ranks raise it at the next
save or at the end, where every rank waits, so that all stop after the same step.

Why not `dcp.async_save` with torch's stagers: `BlockingAsyncStager(cache_staged_state_dict=True)`
pins its buffers unconditionally, which fails on a machine without an accelerator ("Cannot access
accelerator device", torch 2.13 on the CPU); `DefaultStager` in torch 2.11 closes its cache after
every stage (torch issue 183413: no reuse, and a second stage fails). The two helpers
BlockingAsyncStager is made of (`_create_cpu_state_dict`, `_copy_state_dict`: private, but with
these signatures since torch 2.4) are called directly, with pinning only on an accelerator. And
the thread is gpudl's own because what follows DCP's save (the manifest's checksums of every
file, the rename, pruning) must leave the step too, and only after DCP's save on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from ..errors import UserError
from .store import SINGLE_PROCESS, Checkpointer, _collective_failure, all_finite, local_data

# "auto" stages only when this rank's buffers, times the ranks of its node, take at most this share of
# the host's available memory: the rest is the data loader's, the page cache's (the write goes through
# it) and everyone else's. Where they fit it is on, the CPU included: on gpt2-124m on 2 quiet cores a
# save blocked the loop 0.12x as long and the run took 0.89x as long (docs/design.md).
HOST_SHARE = 0.5


def _tensors(tree, prefix: str = ""):
    """(place, tensor) for every tensor in a state dict, DTensors as their local shards (`local_data`)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}.{i}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, local_data(tree)


def _layout(state: dict) -> list:
    """What the buffers must match: every tensor's place, shape and dtype."""
    return [(k, tuple(t.shape), t.dtype) for k, t in _tensors(state)]


class Stager:
    """Copies a state dict into host buffers made at the first save and reused while its layout holds."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._buffers: dict | None = None
        self._layout: list | None = None

    def stage(self, state: dict) -> dict:
        """A copy of `state` that later updates of the live tensors never reach (CPU tensors are copied too)."""
        layout = _layout(state)
        if layout != self._layout:  # the first save, or optimizer state that appeared since (a skipped first step)
            self._buffers = None  # the old buffers go before the new ones come
            self._buffers = _create_cpu_state_dict(state, pin_memory=self.pin)
            self._layout = layout
            self._check_private(state)
        return _copy_state_dict(state, self._buffers)

    def release(self) -> None:
        self._buffers = self._layout = None

    def _check_private(self, state: dict) -> None:
        # torch's helper keeps a 0-dim DTensor as it is (gpudl's models have none): a copy that aliased the live
        # tensor would let later updates into the files
        live = {t.untyped_storage().data_ptr() for _, t in _tensors(state) if t.numel()}
        assert not any(t.untyped_storage().data_ptr() in live for _, t in _tensors(self._buffers) if t.numel())


class BackgroundWriter:
    """Finishes a `Checkpointer`'s saves on a thread of its own, one at a time."""

    def __init__(self, checkpointer: Checkpointer, pin: bool, timeout_s: int = 600, storage=None):
        self.checkpointer = checkpointer
        self.stager = Stager(pin)
        self.storage = storage      # DCP's storage writer for a folder (None: FileSystemWriter, as dcp.save's own)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpudl-checkpoint")
        self._pending: Future | None = None
        # A group of the writer's own (collective: every rank makes it here, in the same order).
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) \
            if dist.is_initialized() else None
        if self.group is None:  # one process: DCP warns from the thread, where catch_warnings is not safe
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
        """Stage checkpoint `step` now (after the previous save is complete) and write it in the background."""
        self.wait()
        final, tmp = self.checkpointer.begin(step, model, check_finite=False)  # the copy is checked in the thread
        staged = self.stager.stage(Checkpointer.state(model, optimizer))
        extra = json.loads(json.dumps(extra))  # as of now: a scheduler's state dict holds its live lists
        self._pending = self._executor.submit(self._write, step, staged, tmp, final, extra)
        return final

    def _write(self, step: int, staged: dict, tmp: Path, final: Path, extra: dict) -> None:
        ckpt = self.checkpointer
        # Weights that are not finite are never written (they would prune the good checkpoints): checked here,
        # on the copy, so that the step boundary pays for the copy alone
        if not all_finite([t for _, t in _tensors(staged["model"])], group=self.group):
            if ckpt.is_writer:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ckpt.not_finite(step)
        ckpt.write(step, staged, tmp, self.group, (self.storage or FileSystemWriter)(str(tmp)))
        ckpt.complete(step, tmp, final, extra, self.group)

    def poll(self) -> None:
        """At a step boundary: raise the failure of a write that has ended. Only where one process decides
        alone; ranks that looked at different steps would stop at different steps."""
        alone = self.group is None or dist.get_world_size(self.group) == 1
        if alone and self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        """Until the save in flight is complete; its failure raised (once), as a synchronous save raises it."""
        pending, self._pending = self._pending, None
        error = pending.exception() if pending is not None else None
        if isinstance(error, UserError) or (error is not None and _collective_failure(error) is error):
            raise error  # worded already, or a rank that failed the save's collectives (the watch names it)
        if error is not None:  # not one of the failures `Checkpointer.write` words: a fault of gpudl's
            raise RuntimeError("the background checkpoint writer failed") from error

    def close(self, raise_error: bool = True) -> None:
        """Wait for the save in flight, then stop the thread. `raise_error=False`: the run is already failing
        with an error of its own; the write still completes (a checkpoint to resume from), its failure unsaid."""
        try:
            self.wait()
        except Exception:
            if raise_error:
                raise
        finally:
            self._executor.shutdown(wait=True)
            self.stager.release()  # the export and the sample after training want that memory


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else the free physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes a staged copy of this rank's state takes: weights, and the optimizer state (before the
    first step, which creates it, two tensors the size of each weight: AdamW's moments)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    weights = sum(p.numel() * p.element_size() for p in local)
    moments = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor))
    return weights + (moments if optimizer.state else 2 * weights)


def choose(asked: bool | str, need_bytes: int, available: int | None,
           cpu_memory_limit: bool = False) -> tuple[bool, str]:
    """Whether saves run in the background, and why in words. `need_bytes`: the staging buffers of every
    rank of this node; `available`: the host's available memory; `cpu_memory_limit`: train.memory_limit
    holds on the CPU, where it counts the buffers too."""
    size = f"{need_bytes / 2**30:.2f} GiB of host buffers"
    if asked is True:
        return True, f"checkpoint.async=true ({size})"
    if asked is False:
        return False, "checkpoint.async=false"
    if cpu_memory_limit:
        return False, "auto: off, train.memory_limit would count the host buffers"
    if available is None or need_bytes > HOST_SHARE * available:
        free = "unknown" if available is None else f"{available / 2**30:.1f} GiB"
        return False, f"auto: off, {size} would not fit in half the host's available memory ({free})"
    return True, f"auto: on ({size}, the host has {available / 2**30:.1f} GiB available)"
