"""Where gpudl keeps what it may reuse between runs (tokenised corpora, measured peaks)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """$GPUDL_CACHE_DIR, else $XDG_CACHE_HOME/gpudl, else ~/.cache/gpudl (created on demand)."""
    root = os.environ.get("GPUDL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "gpudl")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_json(path: Path) -> dict:
    """A cache file's entries; {} where it is missing or unreadable (what it held is measured again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict) -> None:
    """Write a cache file atomically: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
