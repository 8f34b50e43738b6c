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


# The quick tier (`pytest -m quick`, the inner loop: under 3 minutes on 2 cores, docs/testing.md): every
# room of the package, by the test modules below that check it within seconds, nearly all in this process
# (a few one-line refusals of the CLI and one 2-rank Gloo run start processes). A test is quick when its
# module is listed here and it is not one of that module's few slow tests (QUICK_BUT_NOT).
QUICK = {
    # config: settings, TOML and --set, the typed checks; the settings page; --print-config
    "unit/test_config.py", "unit/test_settings_reference.py", "unit/test_print_config.py",
    # device: detection on the real CPU and faked CUDA/ROCm/XPU/MPS, measured peaks, `gpudl info`'s tree
    "unit/test_device.py",
    # models: presets, parameter and FLOP counts, causality, generation; attention kernels; the ResNet stem
    "unit/test_models.py", "unit/test_attention.py", "unit/test_resnet_stem.py",
    # data: batches as functions of (seed, k, rank), text formats, image folders, tokens on the device
    "unit/test_data.py", "unit/test_text_formats.py", "unit/test_image_folder.py", "unit/test_folder_batches.py",
    "unit/test_gpu_decode.py", "unit/test_tokens_on_device.py",
    # distributed: the one order of parallelize, TP and pipeline checks, launch plans; out-of-memory recovery
    # in one process and on two Gloo ranks (ddp-forward: the tier's one run of real processes)
    "unit/test_parallelize.py", "unit/test_tp_checks.py", "unit/test_pipeline_split.py", "unit/test_launch_plan.py",
    "distributed/test_oom_recovery.py",
    # checkpoint: resume bit for bit, refusals of damaged or foreign checkpoints, reading without running code
    "unit/test_checkpoint.py", "unit/test_untrusted_checkpoint.py",
    # observe: MFU against the datasheet and the measured peak, how a missing one is shown
    "unit/test_mfu.py",
    # training: the loop against plain PyTorch, precision, the finiteness guard, host syncs, fp8's linears
    "unit/test_train.py", "unit/test_precision.py", "unit/test_nonfinite_guard.py", "unit/test_host_sync.py",
    "unit/test_fp8.py",
    # memory: the CPU memory limit enforced; the estimate, its breakdown and the out-of-memory fixes it ranks
    "unit/test_memory_limit.py", "unit/test_memory_fixes.py",
    # run: the shared stages of recipes and fit, the Python API, fit's bad input and its resume checks
    "unit/test_stages.py", "unit/test_python_api.py", "unit/test_api.py", "unit/test_fit_bad_input.py",
    "unit/test_fit_resume.py",
    # serve: the engines against no-cache references, the wire formats (OIP, OpenAI), detokenising, threads
    "serve/test_engine.py", "serve/test_oip.py", "serve/test_openai_api.py", "serve/test_detok.py",
    "serve/test_threads.py",
    # CLI: parsing, one-line errors, help texts (in this process; not the smoke runs below)
    "unit/test_cli.py",
    # the front door: the README's commands, code and links; the package graph; the Install page
    "unit/test_readme.py", "unit/test_package_graph.py", "unit/test_install_page.py",
}
# In those modules, the tests that start processes of their own and take their seconds: left to the full suite.
QUICK_BUT_NOT = {
    "unit/test_cli.py": ("test_train_prints_the_device_first_and_leaves_a_complete_run_folder",  # `gpudl train`
                         "test_generate_evaluate_export", "test_info_json_and_tree", "test_debug_shows_the_traceback",
                         "test_resume_refusals_leave_the_run_untouched", "test_the_newest_run_is_the_newest_a_command_"
                         "can_use", "test_generate_at_temperature_zero_is_the_argmax_of_each_step"),
    "unit/test_fit_resume.py": ("test_a_signal_saves_and_the_resumed_fit_is_bit_identical",),  # a real process, signalled
    "unit/test_mfu.py": ("test_bench_quotes_the_datasheet_first_where_the_device_has_one",),  # a whole `gpudl bench`
    "unit/test_memory_fixes.py": ("test_each_fix_saves_what_it_predicts_within_15_percent",),  # six measured jobs
    "distributed/test_oom_recovery.py": ("test_two_ranks_agree_and_recover_with_the_losses_of_the_halved_micro_batch"
                                         "[cpu-ddp-backward]", "test_two_ranks_agree_and_recover_with_the_losses_of_"
                                         "the_halved_micro_batch[cpu-fsdp-forward]"),
}


_MISSING = sorted(m for m in [*QUICK, *QUICK_BUT_NOT] if not (Path(__file__).parent / m).is_file())
assert not _MISSING, f"tests/conftest.py's quick tier names test modules that are not there: {_MISSING}"


def _quick(item) -> bool:
    try:
        module = item.path.relative_to(Path(__file__).parent).as_posix()
    except ValueError:  # a test file outside tests/
        return False
    slow = QUICK_BUT_NOT.get(module, ())
    return module in QUICK and item.name not in slow and item.originalname not in slow


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
        if _quick(item):
            item.add_marker(pytest.mark.quick)
        if Path(__file__).parent / "cluster" in item.path.parents:
            item.add_marker(pytest.mark.cluster)


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


def run_here(*args: str) -> subprocess.CompletedProcess:
    """`gpudl ARGS` in this process: the same parser and commands as `python -m gpudl` (cli.main), without
    the seconds a new interpreter takes to import torch. For a run a test needs made, not one it checks
    as a process (exit status of an uncaught error, signals, start-up): those stay with `run_cli`."""
    import contextlib
    import io

    from gpudl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["gpudl", *args], code, out.getvalue(), err.getvalue())


_MEASURED: dict = {}


def measured_once(mm, case, workdir: Path) -> list[dict]:
    """`mm.measure(case, workdir)` (benchmarks/memory_measure.py: real steps in fresh processes), made once per
    test session for each case: a job measured is the same job whichever test compares its estimate with it
    (test_memory_plan's FSDP case is also test_memory_fixes' FSDP fix)."""
    if case not in _MEASURED:
        _MEASURED[case] = mm.measure(case, workdir)
    return _MEASURED[case]
