"""Checkpoints through `torch.distributed.checkpoint`: sharded, atomic, verified, resumable at any
world size; safetensors export.

A checkpoint is the folder `checkpoints/step_NNNNNNNN/`: the DCP files (model and optimizer,
each rank writing its own shards, and each rank's RNG states), `state.json` (loop position,
schedule, loss scale, which model) and, written last, `manifest.json`. Everything is first
written to a `.tmp` folder that rank 0 renames into place once every rank has finished, so a
crash during a save leaves the previous checkpoint in use. Parameter names are those of the
whole model on every layout, so a checkpoint saved by 4 ranks loads on 2 or 1 (DCP reshards).
Nothing is unpickled with `weights_only=False`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from .ckpt_files import PREFIX, complete_checkpoints, manifest, verify
from .errors import UserError

# Optimizer state keyed by parameter name, hyperparameters too ("param_groups.<name>.lr"): ranks
# that hold different parameters (pipeline stages) would each write a `param_groups` list of their
# own names, of which DCP keeps one.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but a non-tensor entry must first load with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        torch.load(io.BytesIO(data), weights_only=True)  # raises on anything but plain data
        super().load_bytes(read_item, io.BytesIO(data))  # vetted: now place it as DCP does


@contextmanager
def _single_process_ok():
    """DCP warns when it runs without a process group; in one process that is exactly the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type in ("cuda", "xpu"):
        state["device"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state:
        torch.get_device_module(device.type).set_rng_state(state["device"], device)


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters())
    return p.device if not isinstance(p, DTensor) else p.to_local().device


def _dcp_load(sd: dict, ckpt: Path, partial: bool, no_dist: bool) -> None:
    try:
        with _single_process_ok():
            dcp.load(sd, checkpoint_id=str(ckpt), planner=SafeLoadPlanner(allow_partial_load=partial), no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        # The manifest matched, so the bytes are as written: the format is what does not fit.
        raise UserError(f"checkpoint {ckpt} could not be read ({type(e).__name__}): "
                        f"it was written by an incompatible version or is damaged") from None


class Checkpointer:
    """Saves and restores model, optimizer, RNG and loop state under `folder`; keeps the newest `keep`.

    Every rank calls `save` and `load` (they are collective); only the writer (rank 0) writes
    the JSON files, renames and prunes.
    """

    def __init__(self, folder: Path, keep: int, model_fingerprint: dict, is_writer: bool = True):
        self.folder, self.keep, self.fingerprint, self.is_writer = folder, keep, model_fingerprint, is_writer

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
        """Write checkpoint `step`; `extra` is JSON-able loop state (train state, schedule, scaler)."""
        final = self.folder / f"{PREFIX}{step:08d}"
        tmp = self.folder / f"{final.name}.tmp"
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer, options=OPTIM_OPTIONS),
                 f"rng_{_rank()}": _rng_state(_device_of(model))}  # a key per rank: each has its own streams
        with _single_process_ok():
            dcp.save(state, checkpoint_id=str(tmp))
        _barrier()  # every rank's shards and the metadata are on disk
        if self.is_writer:
            (tmp / "state.json").write_text(json.dumps({"model": self.fingerprint, **extra}, indent=1))
            (tmp / "manifest.json").write_text(json.dumps(manifest(tmp), indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)  # the step counts from here on
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        for old in complete_checkpoints(self.folder)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.folder)
        return found[-1] if found else None

    def _verified(self, ckpt: Path, no_dist: bool) -> dict:
        """state.json of an intact checkpoint of this model; rank 0 checks, every rank gets the verdict."""
        if not dist.is_initialized() or no_dist:
            state = verify(ckpt)
            self._check_model(ckpt, state)
            return state
        box = [None, None]
        if _rank() == 0:
            try:
                box[0] = verify(ckpt)
                self._check_model(ckpt, box[0])
            except UserError as e:
                box[1] = str(e)
        dist.broadcast_object_list(box, src=0)
        if box[1]:
            raise UserError(box[1])
        return box[0]

    def _check_model(self, ckpt: Path, state: dict) -> None:
        theirs = state.get("model", {})
        if theirs != self.fingerprint:
            raise UserError(f"checkpoint {ckpt} holds another model ({_fmt(theirs)}) than this run builds "
                            f"({_fmt(self.fingerprint)}): resume with the run's own config, or start a new run")

    def load(self, ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             no_dist: bool = False) -> dict:
        """Restore into `model` (and `optimizer` and RNG states, if given) in place; returns the loop state.

        `no_dist`: this process alone reads the whole model (export after a multi-process run).
        """
        state = self._verified(ckpt, no_dist)
        sd = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            sd["optim"] = get_optimizer_state_dict(model, optimizer, options=OPTIM_OPTIONS)
        _dcp_load(sd, ckpt, partial=optimizer is None, no_dist=no_dist)
        set_model_state_dict(model, sd["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, sd["optim"], options=OPTIM_OPTIONS)
            self._restore_rng(ckpt, _device_of(model), no_dist)
        return state

    def _restore_rng(self, ckpt: Path, device: torch.device, no_dist: bool) -> None:
        """This rank's RNG streams, when the checkpoint has them (not after a change of world size)."""
        key = f"rng_{_rank()}"
        saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        if f"{key}.cpu" not in saved:
            return
        sd = {key: _rng_state(device)}
        _dcp_load(sd, ckpt, partial=True, no_dist=no_dist)
        _set_rng_state(sd[key], device)


def _fmt(fp: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fp.items()) or "unknown"


def model_fingerprint(name: str, config) -> dict:
    """What identifies a model for resuming: its preset and every field that shapes it (not dropout)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "dropout"}
    return {"name": name, **fields}


def export_safetensors(model: nn.Module, path: Path, metadata: dict[str, str]) -> Path:
    """Write a (whole, single-process) model's weights to one safetensors file (shared tensors once)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("exporting to safetensors needs the safetensors package: pip install 'gpudl[export]'") from None
    seen, tensors = set(), {}
    for name, t in get_model_state_dict(model).items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:  # tied weights (GPT's embedding and head) are stored once
            seen.add(key)
            tensors[name] = t.detach().cpu().contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path
