"""Shared test set-up: a private cache (corpus, measured peaks) and small configs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# One cache per test session, so tests never depend on (or disturb) the user's ~/.cache/gpudl.
os.environ.setdefault("GPUDL_CACHE_DIR", tempfile.mkdtemp(prefix="gpudl-test-cache-"))

# Settings that make the default recipe a few-second run.
TINY = ["train.max_steps=6", "train.batch_size=4", "train.log_every=2", "train.eval_every=3",
        "train.eval_batches=2", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
        "model.block_size=32", "sample.tokens=16", "log.progress=false", "train.precision=fp32",
        "train.time_budget_s=0"]  # runs that tests compare must not depend on this machine's speed


@pytest.fixture
def tiny(tmp_path):
    """A tiny GPT config whose run folders live under tmp_path."""
    from gpudl.config import load_config

    return lambda *extra: load_config(None, [*TINY, f"run.dir={tmp_path / 'runs'}", *extra])


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m gpudl ARGS` in a real subprocess; output captured as text."""
    return subprocess.run([sys.executable, "-m", "gpudl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
