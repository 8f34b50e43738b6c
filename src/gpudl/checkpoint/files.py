"""The files of a checkpoint folder: which checkpoints are complete, and whether one is intact.

A checkpoint counts only once its manifest (size and sha256 of every other file) is written,
and it is written last; `verify` checks every file against it before anything is loaded. The
manifest catches damage, not intent (whoever can write the files can write the manifest), so
`verify` also confines every name to the folder and reads `state.json` as strictly typed data.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path, PurePath

from ..errors import UserError

PREFIX = "step_"
# What state.json's loop position holds: counters, each a non-negative integer.
TRAIN_STATE_KEYS = ("step", "batches", "nonfinite_in_a_row", "nonfinite_total")
OPTIONAL_TRAIN_STATE_KEYS = ("micro_batch", "spikes")  # later additions: a checkpoint written before them still loads
# Lists of numbers in train_state, each at most this long: the recent losses loss spikes are measured against.
TRAIN_STATE_LISTS = {"loss_history": 100_000}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(folder: Path) -> dict[str, dict]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"}


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def complete_checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints under `folder`, oldest first (a `.tmp` or manifest-less one never counts)."""
    if not folder.is_dir():
        return []
    done = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and p.name.startswith(PREFIX)
            and p.name[len(PREFIX):].isdigit() and (p / "manifest.json").is_file()]
    return sorted(done, key=step_of)


def damaged(ckpt: Path, what: str) -> UserError:
    return UserError(f"checkpoint {ckpt} is damaged ({what}): delete it to resume from the previous one, "
                     f"or start a new run")


def read_json(ckpt: Path, name: str):
    """A JSON file of the checkpoint, or a UserError naming it."""
    try:
        return json.loads((ckpt / name).read_text(encoding="utf8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise damaged(ckpt, f"{name} is not readable JSON: {str(e).splitlines()[0]}") from e


def _own_file(ckpt: Path, name) -> Path:
    """`ckpt/name`, when it is a plain file directly inside the checkpoint (no `..`, no link out)."""
    if not isinstance(name, str) or PurePath(name).name != name or name in ("", ".", ".."):
        raise damaged(ckpt, f"manifest.json lists {name!r}, which is not a file name")
    path = ckpt / name
    if path.is_symlink():
        raise damaged(ckpt, f"{name} is a link; a checkpoint holds plain files only")
    return path


def _problem(path: Path, want) -> str | None:
    if not isinstance(want, dict) or not isinstance(want.get("bytes"), int) or not isinstance(want.get("sha256"), str):
        return "has no size and checksum in manifest.json"
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"has {size} bytes, expected {want['bytes']}"
    return "has the wrong checksum" if sha256(path) != want["sha256"] else None


def verify(ckpt: Path) -> dict:
    """Check every file against the manifest; returns state.json, or raises a UserError naming the damage."""
    expected = read_json(ckpt, "manifest.json")
    if not isinstance(expected, dict) or "state.json" not in expected:
        raise damaged(ckpt, "manifest.json does not list the checkpoint's files")
    for name, want in expected.items():
        problem = _problem(_own_file(ckpt, name), want)
        if problem:
            raise damaged(ckpt, f"{name} {problem}")
    return check_state(ckpt, read_json(ckpt, "state.json"))


def check_state(ckpt: Path, state) -> dict:
    """state.json as gpudl writes it: the model's fingerprint, counters, and two tables of settings."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise damaged(ckpt, "state.json does not describe a model")
    train = state.get("train_state")
    counters = {k: v for k, v in train.items() if k not in TRAIN_STATE_LISTS} if isinstance(train, dict) else None
    if counters is None or not set(TRAIN_STATE_KEYS) <= set(counters) <= {*TRAIN_STATE_KEYS,
                                                                          *OPTIONAL_TRAIN_STATE_KEYS} or \
            not all(type(v) is int and v >= 0 for v in counters.values()):
        raise damaged(ckpt, f"state.json's train_state must hold the counters {', '.join(TRAIN_STATE_KEYS)} "
                            f"as integers >= 0, got {train!r}")
    for key, longest in TRAIN_STATE_LISTS.items():
        values = train.get(key, [])
        if not isinstance(values, list) or len(values) > longest or \
                not all(type(v) in (int, float) and math.isfinite(v) for v in values):
            raise damaged(ckpt, f"state.json's train_state.{key} must be a list of at most {longest} finite numbers")
    for key in ("scheduler", "scaler"):
        if not isinstance(state.get(key, {}), dict):
            raise damaged(ckpt, f"state.json's {key} must be a table, got {state[key]!r}")
    return state


def _same_shape(saved, live) -> bool:
    """`saved` has the structure and value types of `live`: same keys, same lengths, numbers where numbers are."""
    if isinstance(live, dict):
        return isinstance(saved, dict) and set(saved) == set(live) and all(_same_shape(saved[k], live[k]) for k in live)
    if isinstance(live, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(live) and all(map(_same_shape, saved, live))
    if type(live) is float:
        return type(saved) in (int, float)
    return type(saved) is type(live)


def check_like(ckpt: Path, what: str, saved, live: dict) -> dict:
    """`saved` (from state.json) is shaped like `live`, the state of the object it is loaded into."""
    if not _same_shape(saved, live):
        raise damaged(ckpt, f"state.json's {what} is not the state this run's {what} keeps")
    return saved
