"""Open a finished (or running) run folder: its config, its model with the newest weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .. import models
from ..checkpoint import Checkpointer, model_fingerprint
from ..config import Config, load_config
from ..data import Data
from ..data.tokenizer import run_tokenizer
from ..device import DeviceInfo, detect
from ..errors import UserError
from ..training.job import model_and_data


@dataclass
class Trained:
    run_dir: Path
    cfg: Config
    spec: models.ModelSpec
    model: nn.Module
    data: Data
    device: DeviceInfo
    step: int


def find_run(run_dir: str | None, runs_root: str = "runs", fit_runs: bool = False) -> Path:
    """The run folder asked for, or the newest one under ./runs that this command can use: a run of
    `gpudl.fit` (its config.toml has a [fit] table) holds a user's own model, which no recipe rebuilds, so
    only commands that read what a run wrote (`fit_runs=True`: report) take it."""
    if run_dir is not None:
        path = Path(run_dir)
        if not (path / "config.toml").is_file():
            raise UserError(f"{run_dir!r} is not a gpudl run folder (no config.toml): pass a folder under runs/")
        return path
    root = Path(runs_root)
    runs = [p for p in root.iterdir() if (p / "config.toml").is_file()] if root.is_dir() else []
    if not runs:
        raise UserError(f"no run folder under {runs_root}/: train one first (gpudl train) or pass RUN_DIR")
    usable = [p for p in runs if fit_runs or not is_fit_run(p)]
    if not usable:
        skipped = ", ".join(str(p) for p in sorted(runs)[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
        raise UserError(f"no run folder under {runs_root}/ that a recipe made: {skipped} ran gpudl.fit, whose model "
                        f"is your own module, which no recipe rebuilds: train one with gpudl train or pass RUN_DIR")
    return max(usable, key=lambda p: p.stat().st_mtime)


def is_fit_run(run: Path) -> bool:
    """Whether `gpudl.fit` wrote this run folder: run/fit_resume.py writes its settings as a [fit] table."""
    import tomllib

    try:
        return isinstance(tomllib.loads((run / "config.toml").read_text(encoding="utf8")).get("fit"), dict)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):  # not ours to judge: loading it says what is wrong
        return False


# What a command would need from a gpudl.fit run, whose model is the user's own module (no recipe rebuilds it)
FIT_RUN_NEEDS = {
    "evaluate": "evaluate it where its module is: gpudl.fit(model, train_data, val_data=..., resume={run}) with a "
                "larger max_steps evaluates at its end",
    "generate": "generate with its module in Python",
    "export": "its trained weights are there already",
}


def load_trained(run_dir: Path, device: str = "auto", command: str = "") -> Trained:
    """Rebuild the run's model on `device` and load the weights of its newest checkpoint; a fit run's
    folder gets one line saying what `command` would need instead."""
    if is_fit_run(run_dir):
        left = next((p for p in (run_dir / "model", run_dir / "model.safetensors") if p.exists()), None)
        what = f"its model is your own module, saved in {left}" if left else "its model is your own module"
        raise UserError(f"{run_dir} is a gpudl.fit run ({what}): "
                        f"{FIT_RUN_NEEDS.get(command, 'load it in Python').format(run=repr(str(run_dir)))}")
    cfg = load_config(run_dir / "config.toml")
    info = detect(device)
    spec, data = model_and_data(cfg, tokenizer=run_tokenizer(run_dir))  # the run's text as it trained on it
    model = models.build_to_load(spec, info.torch_device)
    fp = model_fingerprint(spec.name, spec.config)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, fp)
    latest = ckpt.latest()
    if latest is None:
        raise UserError(f"{run_dir} has no complete checkpoint yet: wait for the first save or train longer")
    state = ckpt.load(latest, model, optimizer=None)
    model.eval()
    return Trained(run_dir, cfg, spec, model, data, info, state["train_state"]["step"])
