"""The files of a checkpoint folder: which checkpoints are complete, and whether one is intact.

A checkpoint counts only once its manifest (size and sha256 of every other file) is written,
and it is written last; `verify` checks every file against it before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import UserError

PREFIX = "step_"


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
    done = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
            and p.name[len(PREFIX):].isdigit() and (p / "manifest.json").exists()]
    return sorted(done, key=step_of)


def _damaged(ckpt: Path, what: str) -> UserError:
    return UserError(f"checkpoint {ckpt} is damaged ({what}): delete it to resume from the previous one, "
                     f"or start a new run")


def verify(ckpt: Path) -> dict:
    """Check every file against the manifest; returns state.json, or raises a UserError naming the damage."""
    try:
        expected = json.loads((ckpt / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise _damaged(ckpt, f"unreadable manifest: {e}") from None
    for name, want in expected.items():
        f = ckpt / name
        problem = ("is missing" if not f.exists() else
                   f"has {f.stat().st_size} bytes, expected {want['bytes']}" if f.stat().st_size != want["bytes"] else
                   "has the wrong checksum" if sha256(f) != want["sha256"] else None)
        if problem:
            raise _damaged(ckpt, f"{name} {problem}")
    return json.loads((ckpt / "state.json").read_text())
