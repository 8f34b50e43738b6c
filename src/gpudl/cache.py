"""Where gpudl keeps what it may reuse between runs (tokenised corpora, measured peaks)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
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
    with atomic_file(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or keeps what it held: a crash never leaves half a file under its name."""
    with atomic_file(path) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator:
    """A file written under a temporary name beside `path`, renamed onto it when the block ends well and
    removed when it does not. What the block does before it ends happens before the name appears."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.chmod(tmp, 0o644)  # as a file written plainly would be (mkstemp makes it private)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
