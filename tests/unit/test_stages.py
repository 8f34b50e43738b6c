"""A recipe (`gpudl.train`) and `gpudl.fit` walk the same stages (run/stages.py), and each option they
share reaches each stage the same way: the recorded calls, in order and with the values that arrived,
must be the same for both.

The stage functions are wrapped where `stages.py` calls them, never replaced: each still runs.
Before the shared spine, fit started its session without `parallel.timeout_s`, so the process group
and the step watch of `fit(parallel=ParallelConfig(timeout_s=...))` kept the default of 600 s; the
first test would have failed then.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

import gpudl
import gpudl.run.stages as stages
from gpudl.config import ParallelConfig

QUIET = Console(quiet=True)


def _record(monkeypatch) -> list[tuple]:
    """Wrap each stage `stages.py` calls; the list gets (stage, what of the run's options reached it)."""
    calls: list[tuple] = []
    seen = {
        "start_session": lambda run, console, timeout_s, **k: (run.device, run.seed, timeout_s, k.get("offload")),
        "check_job": lambda cfg, world, precision, model=None: (world, precision),
        "check_compile": lambda setting, device_type, world, parallel, ac: (setting, device_type, ac),
        "plan_parallel": lambda session, parallel, shard=False: (parallel.timeout_s, shard),
        "measured_peak_flops": lambda info, key: (key,),
        "enforce_memory_limit": lambda device, limit, compiled: (limit, compiled),
        "DeviceLoader": lambda source, device, start=0, **k: (str(device), start),
        "background_saves": lambda cfg, session, ckpt, job: (cfg.checkpoint.async_save, session.timeout_s),
        "execute": lambda ex, console: (ex.cfg.train.max_steps, ex.cfg.train.precision, ex.session.timeout_s,
                                        ex.cfg.train.memory_limit, ex.state.step),
    }

    def wrap(name, real, describe):
        @functools.wraps(real)
        def recorded(*args, **kwargs):
            calls.append((name, describe(*args, **kwargs)))
            return real(*args, **kwargs)
        return recorded

    for name, describe in seen.items():
        monkeypatch.setattr(stages, name, wrap(name, getattr(stages, name), describe))
    return calls


def _recipe(tiny, tmp_path, timeout_s: int, limit: str, steps: int) -> None:
    cfg = tiny(f"parallel.timeout_s={timeout_s}", f"train.memory_limit={limit}", f"train.max_steps={steps}",
               "train.precision=fp32", "train.compile=false", "run.name=r", "sample.tokens=0", "train.eval_every=0",
               "checkpoint.export=false", "run.seed=3")
    gpudl.train(cfg, resume="auto", console=QUIET)


def _fit(tmp_path, timeout_s: int, limit: str, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g)
    gpudl.fit(torch.nn.Linear(8, 2), (x, y), loss=F.cross_entropy, max_steps=steps, batch_size=32, device="cpu",
              precision="fp32", compile=False, seed=3, memory_limit=limit, parallel=ParallelConfig(timeout_s=timeout_s),
              run_dir=tmp_path / "fit", resume="auto", progress=False, quiet=True)


@pytest.mark.parametrize("timeout_s,limit", [(77, "12GiB"), (120, "")])
def test_a_recipe_and_fit_call_the_same_stages_with_the_options_given(tiny, tmp_path, monkeypatch, timeout_s, limit):
    calls = _record(monkeypatch)
    _recipe(tiny, tmp_path, timeout_s, limit, steps=2)
    recipe, calls[:] = list(calls), []
    _fit(tmp_path, timeout_s, limit, steps=2)
    fit = list(calls)
    assert [name for name, _ in recipe] == [name for name, _ in fit]
    assert recipe == fit
    assert ("start_session", ("cpu", 3, timeout_s, False)) in fit  # the timeout reaches the process group
    assert ("enforce_memory_limit", (limit, False)) in fit
    assert fit[-1] == ("execute", (2, "fp32", timeout_s, limit, 0))


def test_a_resumed_recipe_and_fit_restore_through_the_same_stages(tiny, tmp_path, monkeypatch):
    """resume="auto" the second time continues each run: the loader starts past the batches trained, and the
    loop at the step the checkpoint holds, both alike."""
    _recipe(tiny, tmp_path, 60, "", steps=2)
    _fit(tmp_path, 60, "", steps=2)
    calls = _record(monkeypatch)
    _recipe(tiny, tmp_path, 60, "", steps=4)
    recipe, calls[:] = list(calls), []
    _fit(tmp_path, 60, "", steps=4)
    assert recipe == calls
    assert ("DeviceLoader", ("cpu", 2)) in calls and calls[-1] == ("execute", (4, "fp32", 60, "", 2))
