"""Nothing lost: a run folder that cannot be written, a full disk, weights gone non-finite, and bad
input each end in one line with the last good checkpoint intact."""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from conftest import TINY, run_here
from gpudl.checkpoint import complete_checkpoints
from gpudl.checkpoint.files import verify
from gpudl.cli import main
from gpudl.config import load_config
from gpudl.errors import UserError
from gpudl.run.recipe import train

QUIET = Console(quiet=True)
SETS = [a for item in TINY for a in ("--set", item)]


def one_line(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return code, err


@pytest.fixture
def saved(tiny):
    """A finished run with checkpoints at steps 2 and 4."""
    return train(tiny("run.name=ok", "train.max_steps=4", "checkpoint.every=2", "checkpoint.export=false"),
                 console=QUIET).run_dir


@pytest.mark.parametrize("argv, words", [
    (["train", "--set", "optim.lr=inf"], "optim.lr must be a finite number, got inf"),
    (["train", "--set", "optim.lr=nan"], "optim.lr must be a finite number, got nan"),
    (["train", "--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
    (["train", "--set", "run.name=../../escaped"], "run.name must be a folder name inside run.dir"),
    (["train", "--set", "run.dir=/proc/gpudl-runs"], "cannot write the run folder /proc/gpudl-runs/"),
])
def test_bad_run_settings_are_one_line(capsys, tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    code, err = one_line(capsys, *argv)
    assert code == 2 and words in err, err
    assert not any(tmp_path.rglob("*"))  # nothing written anywhere
    assert not (tmp_path.parent.parent / "escaped").exists()


def test_a_run_dir_that_is_a_file_is_one_line(capsys, tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    code, err = one_line(capsys, "train", *SETS, "--set", f"run.dir={tmp_path / 'taken'}")
    assert code == 2 and "cannot write the run folder" in err and "Not a directory" in err
    assert (tmp_path / "taken").read_text() == "not a folder"


def test_export_makes_its_folder_and_refuses_a_folder_as_file(capsys, saved, tmp_path):
    out = tmp_path / "new" / "deeper" / "m.safetensors"
    assert main(["export", str(saved), "--out", str(out)]) == 0 and out.stat().st_size > 1000
    code, err = one_line(capsys, "export", str(saved), "--out", str(tmp_path / "new"))
    assert code == 2 and "is a folder: give a file name" in err


def test_weights_gone_non_finite_never_replace_the_good_checkpoints(saved):
    """A peak lr past fp32's range (set on resume: it takes effect) makes the next update Inf: the save at
    step 6 refuses, the good checkpoints stay, and the run ends with one line."""
    before = [(c.name, verify(c)) for c in complete_checkpoints(saved / "checkpoints")]
    cfg = load_config(saved / "config.toml", ["optim.lr=1e39", "optim.warmup_steps=0", "train.max_steps=8"])
    with pytest.raises(UserError, match="weights are not finite .* at step 6: no checkpoint written, the last good "
                                        "one, .*step_00000004, is kept"):
        train(cfg, resume=saved, console=QUIET)
    assert [(c.name, verify(c)) for c in complete_checkpoints(saved / "checkpoints")] == before
    assert not list((saved / "checkpoints").glob("*.tmp"))


def test_a_checkpoint_with_non_finite_weights_is_refused(saved):
    """As a corrupted shard would leave it: step 6 rewritten with one Inf weight; resuming from it is refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from gpudl.checkpoint.files import manifest
    from gpudl.checkpoint.store import OPTIM_OPTIONS

    run = train(load_config(saved / "config.toml", ["train.max_steps=6"]), resume=saved, console=QUIET)
    newest = complete_checkpoints(saved / "checkpoints")[-1]
    with torch.no_grad():
        next(run.model.parameters())[0, 0] = math.inf
    dcp.save({"model": get_model_state_dict(run.model), "rng_0": {"cpu": torch.get_rng_state()},
              "optim": get_optimizer_state_dict(run.model, run.optimizer, options=OPTIM_OPTIONS)},
             checkpoint_id=str(newest))
    (newest / "manifest.json").write_text(json.dumps(manifest(newest)))
    with pytest.raises(UserError, match="step_00000006 holds weights that are not finite"):
        train(load_config(saved / "config.toml", ["train.max_steps=8"]), resume=saved, console=QUIET)


def test_a_new_peak_lr_on_resume_takes_effect(saved):
    cfg = load_config(saved / "config.toml", ["optim.lr=0.5", "train.max_steps=6"])
    run = train(cfg, resume=saved, console=QUIET)
    lrs = [r["lr"] for r in run.records if r["kind"] == "train"]
    assert lrs and all(lr > 0.01 for lr in lrs)  # the old peak (3e-3) would keep every lr below it


def _limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_failed_save_leaves_the_previous_checkpoint_and_says_so(saved):
    """No file may grow past 20 kB (the kernel refuses the write, as a full disk does): the shards cannot be
    written; the run stops with one line and step 4's checkpoint is intact."""
    before = [(c.name, verify(c)) for c in complete_checkpoints(saved / "checkpoints")]
    out = subprocess.run([sys.executable, "-m", "gpudl", "train", "--resume", str(saved), "--set", "train.max_steps=8"],
                         capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size(20_000))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "could not write checkpoint step 6 to" in out.stderr and "file too large" in out.stderr.lower()
    assert "step_00000004, is kept" in out.stderr and f"--resume {saved}" in out.stderr
    assert [(c.name, verify(c)) for c in complete_checkpoints(saved / "checkpoints")] == before
    assert not list((saved / "checkpoints").glob("*.tmp"))


def test_a_run_whose_last_steps_were_skipped_fails_and_records_no_zero_loss():
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)]
    batches[-2:] = [(torch.full_like(b[0], math.inf), b[1]) for b in batches[-2:]]  # the last two give NaN grads
    model = torch.nn.Linear(4, 2)
    with pytest.raises(UserError, match="the last 2 of 8 steps had NaN/Inf gradients and were skipped, so the "
                                        "weights are those of step 6"):
        import gpudl
        gpudl.fit(model, batches, loss=F.cross_entropy, max_steps=8, log_every=4, device="cpu", precision="fp32",
                  progress=False, quiet=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_window_of_skipped_steps_logs_nan_not_zero():
    from gpudl.config import TrainConfig
    from gpudl.device import cpu_info
    from gpudl.observe.metrics import Throughput
    from gpudl.training.loop import TrainState
    from gpudl.run.monitor import Monitor
    from gpudl.distributed.session import Session

    monitor = Monitor(session=Session(cpu_info()), train=TrainConfig(log_every=2, max_steps=4),
                      throughput=Throughput(1, 1, 1, 1.0))
    state = TrainState()
    for loss in (math.inf, math.nan, 1.0, 3.0):
        state.step += 1
        monitor.on_step(state, torch.tensor(loss), torch.tensor(loss), 0.1)
    assert math.isnan(monitor.records[0]["loss"]) and monitor.records[1]["loss"] == 2.0


def test_a_small_validation_part_is_evaluated_once_with_a_short_batch(capsys, tmp_path, monkeypatch):
    """40 held-out images, batch 64: evaluated as one batch of 40, however many batches are asked for."""
    monkeypatch.chdir(tmp_path)
    small = ["--config", "resnet18", "--set", "model.width=8", "--set", "train.batch_size=64",
             "--set", "data.val_fraction=0.01", "--set", "train.max_steps=2", "--set", "train.eval_every=0",
             "--set", "data.image_size=16", "--set", "log.progress=false", "--set", "run.name=small",
             "--set", "train.precision=fp32", "--set", "run.device=cpu"]
    out = run_here("train", *small)  # in this process (conftest.run_here), in tmp_path (chdir above)
    assert out.returncode == 0 and "Evaluation: none" not in out.stdout, out.stderr
    records = [json.loads(line) for line in (tmp_path / "runs/small/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2]
    assert main(["evaluate", "runs/small", "--json", "--batches", "50"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] == 40 and 0 <= result["accuracy"] <= 1 and result["loss"] > 0


def test_train_says_when_there_is_nothing_to_evaluate(tmp_path):
    # the run in this process (conftest.run_here); the refusal below in a process of its own, as a user meets it
    out = run_here("train", *SETS, "--set", "data.val_fraction=0", "--set", "run.name=noval",
                   "--set", "train.max_steps=2", "--set", f"run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert "Evaluation: none, the data has no validation part (data.val_fraction is 0: set it > 0" in out.stdout
    code = subprocess.run([sys.executable, "-m", "gpudl", "evaluate", str(tmp_path / "noval")], capture_output=True,
                          text=True, timeout=120)
    assert code.returncode == 2 and "data.val_fraction is 0: set it > 0" in code.stderr
