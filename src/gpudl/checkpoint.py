"""Checkpoints through `torch.distributed.checkpoint`: atomic, verified, resumable; safetensors export.

A checkpoint is the folder `checkpoints/step_NNNNNNNN/`: the DCP files (model, optimizer,
RNG states), `state.json` (loop position, schedule, loss scale, which model) and, written
last, `manifest.json` (size and sha256 of every file). Everything is first written to a
`.tmp` folder that is renamed into place only when complete, so a crash during a save leaves
the previous checkpoint in use. Nothing is unpickled with `weights_only=False`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from .errors import UserError

PREFIX = "step_"


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


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type in ("cuda", "xpu"):
        state["device"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state:
        torch.get_device_module(device.type).set_rng_state(state["device"], device)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, dict]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"}


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def complete_checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints under `folder`, oldest first (a `.tmp` or manifest-less one never counts)."""
    if not folder.is_dir():
        return []
    done = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
            and p.name[len(PREFIX):].isdigit() and (p / "manifest.json").exists()]
    return sorted(done, key=step_of)


def verify(ckpt: Path) -> dict:
    """Check every file against the manifest; returns state.json, or raises a UserError naming the damage."""
    try:
        expected = json.loads((ckpt / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint {ckpt} is damaged (unreadable manifest: {e}): delete it to resume from the "
                        f"previous one, or start a new run") from None
    for name, want in expected.items():
        f = ckpt / name
        problem = ("is missing" if not f.exists() else
                   f"has {f.stat().st_size} bytes, expected {want['bytes']}" if f.stat().st_size != want["bytes"] else
                   "has the wrong checksum" if _sha256(f) != want["sha256"] else None)
        if problem:
            raise UserError(f"checkpoint {ckpt} is damaged ({name} {problem}): delete it to resume from the "
                            f"previous one, or start a new run")
    return json.loads((ckpt / "state.json").read_text())


class Checkpointer:
    """Saves and restores model, optimizer, RNG and loop state under `folder`; keeps the newest `keep`."""

    def __init__(self, folder: Path, keep: int, model_fingerprint: dict, is_writer: bool = True):
        self.folder, self.keep, self.fingerprint, self.is_writer = folder, keep, model_fingerprint, is_writer

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
        """Write checkpoint `step`; `extra` is JSON-able loop state (train state, schedule, scaler)."""
        final = self.folder / f"{PREFIX}{step:08d}"
        tmp = self.folder / f"{final.name}.tmp"
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        device = next(model.parameters()).device
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
                 "rng": _rng_state(device)}
        with _single_process_ok():
            dcp.save(state, checkpoint_id=str(tmp))
        if self.is_writer:
            (tmp / "state.json").write_text(json.dumps({"model": self.fingerprint, **extra}, indent=1))
            (tmp / "manifest.json").write_text(json.dumps(_manifest(tmp), indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)  # the step counts from here on
            self._prune()
        return final

    def _prune(self) -> None:
        for old in complete_checkpoints(self.folder)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.folder)
        return found[-1] if found else None

    def check_model(self, ckpt: Path, state: dict) -> None:
        theirs = state.get("model", {})
        if theirs != self.fingerprint:
            raise UserError(f"checkpoint {ckpt} holds another model ({_fmt(theirs)}) than this run builds "
                            f"({_fmt(self.fingerprint)}): resume with the run's own config, or start a new run")

    def load(self, ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Restore into `model` (and `optimizer`, if given) in place; returns the saved loop state."""
        state = verify(ckpt)
        self.check_model(ckpt, state)
        device = next(model.parameters()).device
        sd = {"model": get_model_state_dict(model), "rng": _rng_state(device)}
        if optimizer is not None:
            sd["optim"] = get_optimizer_state_dict(model, optimizer)
        try:
            with _single_process_ok():
                dcp.load(sd, checkpoint_id=str(ckpt), planner=SafeLoadPlanner(allow_partial_load=optimizer is None))
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            # The manifest matched, so the bytes are as written: the format is what does not fit.
            raise UserError(f"checkpoint {ckpt} could not be read ({type(e).__name__}): "
                            f"it was written by an incompatible version or is damaged") from None
        set_model_state_dict(model, sd["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, sd["optim"])
            _set_rng_state(sd["rng"], device)
        return state


def _fmt(fp: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fp.items() if k != "shapes") or "unknown"


def model_fingerprint(name: str, config: dict, model: nn.Module) -> dict:
    """What identifies a model for resuming: preset, its config, and every parameter's shape."""
    shapes = {k: list(v.shape) for k, v in get_model_state_dict(model, options=StateDictOptions()).items()}
    return {"name": name, **config, "shapes": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]}


def export_safetensors(model: nn.Module, path: Path, metadata: dict[str, str]) -> Path:
    """Write the model's full weights to one safetensors file (shared tensors once)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("exporting to safetensors needs the safetensors package: pip install 'gpudl[export]'") from None
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    seen, tensors = set(), {}
    for name, t in full.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:  # tied weights (GPT's embedding and head) are stored once
            seen.add(key)
            tensors[name] = t.detach().cpu().contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path
