"""Shared test set-up: a private cache (corpus, measured peaks), small configs, and the device axis.

The bodies that exercise the training path take the device as a parameter (`device` below): they
run on the CPU everywhere and, where torch reports an accelerator (CUDA, ROCm, XPU, MPS, ...), on it
too; elsewhere that half is skipped with the reason. Every test that runs on an accelerator carries
the `accelerator` marker, so `pytest -m accelerator` is exactly the accelerator tier and
`pytest -m "not accelerator"` the CPU one. Tests that are not about the device pin the CPU
(`run.device=cpu` in TINY), so that they ask the same of a GPU machine as of a laptop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# One cache per test session, so tests never depend on (or disturb) the user's ~/.cache/gpudl.
os.environ.setdefault("GPUDL_CACHE_DIR", tempfile.mkdtemp(prefix="gpudl-test-cache-"))

# Settings that make the default recipe a few-second run, on the CPU whatever the machine has
# (`tiny(f"run.device={device}")` moves it). Eager: compile's "auto" turns it on for GPUs, and a
# compiled step would neither be quick nor compute what the eager runs these tests compare with do.
TINY = ["train.max_steps=6", "train.batch_size=4", "train.log_every=2", "train.eval_every=3",
        "train.eval_batches=2", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
        "model.block_size=32", "sample.tokens=16", "log.progress=false", "train.precision=fp32",
        "train.time_budget_s=0",  # runs that tests compare must not depend on this machine's speed
        "run.device=cpu", "train.compile=false"]

NO_ACCELERATOR = "no accelerator on this machine (torch.accelerator.is_available() is False)"


def accelerator_type() -> str | None:
    """torch's device type of this machine's accelerator ("cuda" on ROCm too), or None without one."""
    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else None


def pytest_configure(config):
    config.addinivalue_line("markers", "accelerator: runs on this machine's accelerator (CUDA, ROCm, XPU, MPS, ...); "
                                       "skipped, with the reason, where there is none")


def _on_accelerator(item) -> bool:
    # The `device` fixture's accelerator half (a test's own "device" parameter that names a faked
    # backend, as test_attention's, runs on the CPU), or a test that asks for `accelerator` itself.
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    return "accelerator" in getattr(item, "fixturenames", ()) or params.get("device") == "accelerator"


def pytest_collection_modifyitems(config, items):
    # What runs on an accelerator is marked here, once, whichever way it got there: the device
    # parameter's accelerator half, or a test that asks for the `accelerator` fixture itself.
    for item in items:
        if _on_accelerator(item) and not item.get_closest_marker("accelerator"):
            item.add_marker(pytest.mark.accelerator)


@pytest.fixture
def accelerator() -> str:
    """The accelerator's device type, for a test that only makes sense on one; skipped without one."""
    found = accelerator_type()
    if found is None:
        pytest.skip(NO_ACCELERATOR)
    return found


@pytest.fixture(params=["cpu", "accelerator"])
def device(request) -> str:
    """The device a body runs on: "cpu", then this machine's accelerator type (skipped without one)."""
    if request.param == "cpu":
        return "cpu"
    return request.getfixturevalue("accelerator")


@pytest.fixture
def tiny(tmp_path):
    """A tiny GPT config whose run folders live under tmp_path (on the CPU unless `run.device=` says)."""
    from gpudl.config import load_config

    return lambda *extra: load_config(None, [*TINY, f"run.dir={tmp_path / 'runs'}", *extra])


@pytest.fixture
def no_accelerator(monkeypatch):
    """This machine as one without an accelerator, as far as gpudl can ask torch (a CPU-only laptop)."""
    import gpudl.device.discovery as discovery

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(discovery, "_xla_present", lambda: False)  # torch_xla installed is a TPU host


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m gpudl ARGS` in a real subprocess; output captured as text."""
    return subprocess.run([sys.executable, "-m", "gpudl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
