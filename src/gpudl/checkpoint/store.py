"""Checkpoints through `torch.distributed.checkpoint`: sharded, atomic, verified, resumable at any
world size.

A checkpoint is the folder `checkpoints/step_NNNNNNNN/`: the DCP files (model and optimizer,
each rank writing its own shards, and each rank's RNG states), `state.json` (loop position,
schedule, loss scale, which model) and, written last, `manifest.json`. Everything is first
written to a `.tmp` folder that rank 0 renames into place once every rank has finished, so a
crash during a save leaves the previous checkpoint in use. Parameter names are those of the
whole model on every layout, so a checkpoint saved by 4 ranks loads on 2 or 1, and one saved by 1
on 2 or 4 (DCP reshards; RNG states as `streams.py` says).
Loading never runs code from the files (see `reader.py`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import threading
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..device.accel import rng_state, set_rng_state
from ..distributed.agree import broadcast_json
from ..distributed.watch import StepWatch, is_peer_lost, is_timeout
from ..errors import UserError
from .files import PREFIX, complete_checkpoints, damaged, manifest, verify
from .reader import (METADATA_FILE, MissingEntries, SafeLoadPlanner, SafeReader, UnsafeCheckpointFile, check_byte_entries,
                     check_storage_files, read_metadata_file)
from .streams import reseed, restores, saved_world

# What DCP warns when it saves or loads without a process group: in one process, exactly the intent.
SINGLE_PROCESS = ".*assuming the intent is to (save|load) in a single process.*"

# Optimizer state keyed by parameter name, hyperparameters too ("param_groups.<name>.lr"): ranks
# that hold different parameters (pipeline stages) would each write a `param_groups` list of their
# own names, of which DCP keeps one.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@contextmanager
def _single_process_ok():
    """DCP warns when it runs without a process group; in one process that is exactly the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS)
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world(no_dist: bool = False) -> int:
    return dist.get_world_size() if dist.is_initialized() and not no_dist else 1


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if (on_device := rng_state(device)) is not None:
        state["device"] = on_device
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state:
        set_rng_state(device, state["device"])


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters())
    return p.device if not isinstance(p, DTensor) else p.to_local().device


def _unsafe(ckpt: Path, e: UnsafeCheckpointFile) -> UserError:
    return UserError(f"checkpoint {ckpt} was not loaded: {e.name} {e.why}; gpudl never writes that, so "
                     f"the file was made or changed elsewhere: delete the checkpoint, and do not trust its source")


def _refusal(ckpt: Path, e: BaseException) -> UserError:
    """One line for a failed DCP load: the file that was refused, or what did not fit."""
    failures = e.failures.values() if isinstance(e, CheckpointException) else [(e, None)]
    for exc, _ in failures:
        if isinstance(exc, UnsafeCheckpointFile):
            return _unsafe(ckpt, exc)
        if isinstance(exc, MissingEntries):
            return damaged(ckpt, f"it holds {exc}, which this model has")
    # The manifest matched, so the bytes are as written: the format is what does not fit.
    return UserError(f"checkpoint {ckpt} could not be read ({type(e).__name__}): "
                     f"it was written by an incompatible version or is damaged")


def _collective_failure(e: BaseException) -> BaseException | None:
    """The failure of the load's communication (a timeout, a rank gone) in `e`, if that is what failed, rather
    than the reading of a file: never the files' fault."""
    failures = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    return next((exc for exc in failures if isinstance(exc, dist.DistError) or is_timeout(exc) or is_peer_lost(exc)),
                None)


def _dcp_load(sd: dict, ckpt: Path, partial: bool, no_dist: bool) -> None:
    try:
        with _single_process_ok():
            dcp.load(sd, storage_reader=SafeReader(ckpt), planner=SafeLoadPlanner(allow_partial_load=partial, required="model." if partial else None),
                     no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        failure = _collective_failure(e)
        if failure is e:
            raise  # the caller's watch names the collective and the late rank
        if failure is not None:
            raise failure from e  # unwrapped from DCP's gathered failures, for the same watch
        raise _refusal(ckpt, e) from e


def vet(ckpt: Path) -> dict:
    """state.json of an intact checkpoint whose metadata is safe to hand to DCP; a UserError otherwise.

    Its `world_size` (how many processes saved it) is filled in from the RNG states for a checkpoint
    written before it was recorded."""
    state = verify(ckpt)
    try:
        metadata = read_metadata_file(ckpt / METADATA_FILE)
        check_storage_files(metadata, ckpt)
        check_byte_entries(metadata, ckpt)
    except UnsafeCheckpointFile as e:
        raise _unsafe(ckpt, e) from e
    return {**state, "world_size": saved_world(ckpt, state, metadata)}


def local_data(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose values a checkpoint holds for `t`: a DTensor's local shard, and in a wrapper subclass
    the tensor it wraps (torchao's float8 weights under FSDP2, `WeightWithDynamicFloat8CastTensor`, keep the
    fp32 weight as their first inner tensor; the wrapper has no storage of its own)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
    return t


def _all_finite(model: nn.Module, collective: bool = True) -> bool:
    """Every rank's weights are finite (one collective: each rank checks the parameters it holds).

    The state dict's, which FSDP2 gives as the shards even where an evaluation left a block gathered
    (its gathered weights may be float8 tensors, on which `isfinite` does not run)."""
    return all_finite([local_data(t) for t in model.state_dict().values() if isinstance(t, torch.Tensor)],
                      collective)


def all_finite(tensors: list[torch.Tensor], collective: bool = True, group: dist.ProcessGroup | None = None) -> bool:
    """Every rank's `tensors` are finite (one collective over `group`: each rank checks its own)."""
    flags = [torch.isfinite(t.detach()).all() for t in tensors]
    home = flags[0].device  # weights FSDP's CPU offload keeps on the host answer there: their flags join the rest
    ok = torch.stack([f.to(home) for f in flags]).all().to(torch.int32)
    if collective and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok)


def _write_error(folder: Path, e: BaseException) -> str:
    """What went wrong with a write, in words: a full disk is the usual reason, and torch's own message hides it."""
    causes = [e, *(exc for exc, _ in e.failures.values())] if isinstance(e, CheckpointException) else [e]
    for cause in causes:
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                return "the disk is full"
            if isinstance(cause, OSError) and cause.strerror:
                return cause.strerror.lower()
            cause = cause.__cause__ or cause.__context__
    try:
        if shutil.disk_usage(folder).free < 64 * 2**20:
            return "the disk is full"
    except OSError:
        pass
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}"


class Checkpointer:
    """Saves and restores model, optimizer, RNG and loop state under `folder`; keeps the newest `keep`.

    Every rank calls `save` and `load` (they are collective); only the writer (rank 0) writes
    the JSON files, renames and prunes.
    """

    def __init__(self, folder: Path, keep: int, model_fingerprint: dict, is_writer: bool = True,
                 watch: StepWatch | None = None):
        self.folder, self.keep, self.fingerprint, self.is_writer = folder, keep, model_fingerprint, is_writer
        self.watch = watch  # names the collective and the late rank when a load's collective times out

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
        """Write checkpoint `step`; `extra` is JSON-able loop state (train state, schedule, scaler).

        Weights that are not finite are never saved (they would prune the good checkpoints), and
        a write that fails (a full disk) leaves the previous checkpoint as it was: a UserError either way.
        (`background.py` runs the same steps, the last two on a thread of its own.)
        """
        final, tmp = self.begin(step, model)
        self.write(step, self.state(model, optimizer), tmp)
        self.complete(step, tmp, final, extra)
        return final

    def begin(self, step: int, model: nn.Module, check_finite: bool = True) -> tuple[Path, Path]:
        """Checkpoint `step`'s folder and its empty `.tmp` stand-in; refused for weights that are not finite
        (`check_finite=False`: the caller checks them itself, as a background save checks its copy)."""
        final = self.folder / f"{PREFIX}{step:08d}"
        tmp = self.folder / f"{final.name}.tmp"
        if check_finite and not _all_finite(model):
            raise self.not_finite(step)
        self._on_writer(lambda: (shutil.rmtree(tmp, ignore_errors=True), tmp.mkdir(parents=True)), step, tmp)
        return final, tmp

    def not_finite(self, step: int) -> UserError:
        return UserError(f"the weights are not finite (NaN or Inf) at step {step}: no checkpoint written, "
                         f"{self._kept()}; lower optim.lr, or use precision=bf16-mixed or fp32")

    @staticmethod
    def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """What DCP writes: the live tensors themselves, not copies (a save that outlives the step copies them)."""
        return {"model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optimizer, options=OPTIM_OPTIONS),
                f"rng_{_rank()}": _rng_state(_device_of(model))}  # a key per rank: each has its own streams

    def write(self, step: int, state: dict, tmp: Path, group: dist.ProcessGroup | None = None,
              storage_writer=None) -> None:
        """DCP's save of `state` into `tmp`, collective over `group` (None: the default group); a failure on
        any rank fails it on all, removes `tmp` and is a UserError."""
        # catch_warnings swaps a process-wide filter list: only the main thread may (background.py filters once)
        quiet = _single_process_ok() if threading.current_thread() is threading.main_thread() else nullcontext()
        try:
            with quiet:
                dcp.save(state, checkpoint_id=str(tmp), storage_writer=storage_writer, process_group=group)
        except (Exception, CheckpointException) as e:
            if self.is_writer:
                shutil.rmtree(tmp, ignore_errors=True)
            failure = _collective_failure(e)
            if failure is not None:  # a rank or the network failed, not the folder: the caller's watch names it
                raise failure from e
            raise self._write_failed(step, e) from e

    def complete(self, step: int, tmp: Path, final: Path, extra: dict, group: dist.ProcessGroup | None = None) -> None:
        """Once every rank wrote its shards: state.json, manifest, rename (on the writer; all learn the outcome)."""
        self._on_writer(lambda: self._finish(tmp, final, extra), step, tmp, group)

    def _finish(self, tmp: Path, final: Path, extra: dict) -> None:
        (tmp / "state.json").write_text(json.dumps({"model": self.fingerprint, "world_size": _world(), **extra},
                                                   indent=1))
        (tmp / "manifest.json").write_text(json.dumps(manifest(tmp), indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the step counts from here on
        self._prune()

    def _on_writer(self, write, step: int, tmp: Path, group: dist.ProcessGroup | None = None) -> None:
        """`write()` on the writer; every rank learns (over `group`) whether it failed (none waits for the others)."""
        error = None
        if self.is_writer:
            try:
                write()
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                error = str(self._write_failed(step, e))
        if dist.is_initialized():
            error = broadcast_json(error, group)
        if error:
            raise UserError(error)

    def _kept(self) -> str:
        latest = self.latest()
        return f"the last good one, {latest}, is kept" if latest else "there is no earlier checkpoint"

    def _write_failed(self, step: int, e: BaseException) -> UserError:
        return UserError(f"could not write checkpoint step {step} to {self.folder}: {_write_error(self.folder, e)}; "
                         f"{self._kept()}: make room, then resume with --resume {self.folder.parent}")

    def _prune(self) -> None:
        for old in complete_checkpoints(self.folder)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.folder)
        return found[-1] if found else None

    def _verified(self, ckpt: Path, no_dist: bool) -> dict:
        """state.json of an intact checkpoint of this model; rank 0 checks, every rank gets the verdict."""
        if not dist.is_initialized() or no_dist:
            state = vet(ckpt)
            self._check_model(ckpt, state)
            return state
        box = [None, None]
        if _rank() == 0:
            try:
                box[0] = vet(ckpt)
                self._check_model(ckpt, box[0])
            except UserError as e:
                box[1] = str(e)
        box = broadcast_json(box)
        if box[1]:
            raise UserError(box[1])
        return box[0]

    def _check_model(self, ckpt: Path, state: dict) -> None:
        theirs = state.get("model", {})
        if theirs != self.fingerprint:
            raise UserError(f"checkpoint {ckpt} holds another model ({_fmt(theirs)}) than this run builds "
                            f"({_fmt(self.fingerprint)}): resume with the run's own config, or start a new run")

    def load(self, ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             no_dist: bool = False, seed: int = 0) -> dict:
        """Restore into `model` (and `optimizer` and the RNG streams, if given) in place; returns the loop
        state (state.json, its `world_size` the saving job's). Any number of processes loads a checkpoint
        of any number: the RNG states are restored where the two are equal, else re-seeded from `seed`.

        Every rank enters each collective or none: what decides is rank 0's verdict, the same everywhere.
        `no_dist`: this process alone reads the whole model (export after a multi-process run).
        """
        with self._during("verdict broadcast from rank 0"):
            state = self._verified(ckpt, no_dist)
        sd = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            sd["optim"] = get_optimizer_state_dict(model, optimizer, options=OPTIM_OPTIONS)
        with self._during("load plan exchange / read (DCP)"):
            _dcp_load(sd, ckpt, partial=optimizer is None, no_dist=no_dist)
        set_model_state_dict(model, sd["model"])
        with self._during("finiteness all-reduce"):
            finite = _all_finite(model, collective=not no_dist)
        if not finite:
            raise UserError(f"checkpoint {ckpt} holds weights that are not finite (NaN or Inf): delete it to "
                            f"resume from the one before, or start a new run")
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, sd["optim"], options=OPTIM_OPTIONS)
            self._restore_rng(ckpt, state, _device_of(model), no_dist, seed)
        return state

    def _during(self, collective: str):
        return self.watch.during("checkpoint load", collective) if self.watch is not None else nullcontext()

    def _restore_rng(self, ckpt: Path, state: dict, device: torch.device, no_dist: bool, seed: int) -> None:
        """This rank's RNG streams as saved, when as many processes saved them as load them; else re-seeded."""
        if not restores(state["world_size"], _world(no_dist)):
            reseed(seed, _rank(), state["train_state"]["step"])
            return
        key = f"rng_{_rank()}"
        sd = {key: _rng_state(device)}
        with self._during("RNG load plan exchange / read (DCP)"):
            _dcp_load(sd, ckpt, partial=True, no_dist=no_dist)  # partial: a CPU run's states lack "device"
        _set_rng_state(sd[key], device)


def _fmt(fp: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fp.items()) or "unknown"


def model_fingerprint(name: str, config) -> dict:
    """What identifies a model for resuming: its preset and every field that shapes it (not dropout)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "dropout"}
    return {"name": name, **fields}
