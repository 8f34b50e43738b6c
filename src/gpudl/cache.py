"""Where gpudl keeps what it may reuse between runs (tokenised corpora, measured peaks)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$GPUDL_CACHE_DIR, else $XDG_CACHE_HOME/gpudl, else ~/.cache/gpudl (created on demand)."""
    root = os.environ.get("GPUDL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "gpudl")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
