"""`gpudl.fit`'s run folder: where it writes, its checkpoints of a user's module, and resuming them.

A fit's folder holds what a recipe's holds (config.toml, metrics, checkpoints/ in the same
`Checkpointer` store, summary), and its config.toml has a `[fit]` table besides: what a resumed
fit must match for its steps to train on the samples they trained on before (the samples per
batch, the accumulation, the seed, the processes, the kind of data) and the model's class.
Everything read from the folder is data (TOML, JSON, DCP through the checkpoint's safe reader),
at fixed names inside it.
"""

from __future__ import annotations

import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from torch import nn

from ..checkpoint import Checkpointer, complete_checkpoints
from ..checkpoint.files import read_json
from ..config import Config
from ..config.settings import dump_toml, to_dict
from ..errors import UserError
from ..training.loop import Job, TrainState
from .run_dir import prepare_run_dir, restore_job
from ..distributed.session import Session

# What a resumed fit must repeat, in the words of fit's keywords.
MUST_MATCH = ("batch_size", "grad_accum", "seed", "processes", "data")


def module_fingerprint(model: nn.Module) -> dict:
    """What identifies a user's module for resuming: its class, and its parameters' names, dtypes and shapes."""
    cls = type(model)
    return {"name": f"{cls.__module__}.{cls.__qualname__}",
            "parameters": {name: f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
                           for name, p in model.named_parameters()}}


@dataclass
class FitRun:
    """Where a fit writes (None: nowhere) and whether it continues the run there."""

    folder: Path | None
    resuming: bool = False


def resolve_fit_run(run_dir, resume, session: Session) -> FitRun:
    """The run folder from fit's `run_dir` and `resume`, checked (on rank 0, the verdict on every rank)
    before anything is trained or written."""
    if resume is None:
        return FitRun(_new_folder(Path(run_dir), session) if run_dir is not None else None)
    if resume == "auto":
        if run_dir is None:
            raise UserError("resume='auto' continues run_dir when it holds a checkpoint and starts it otherwise: "
                            "pass run_dir= too")
        folder = Path(run_dir)
        if not session.agree(bool(complete_checkpoints(folder / "checkpoints"))):
            return FitRun(folder)  # a first attempt, or one that died before its first checkpoint: start over
    else:
        folder = Path(resume)
        if run_dir is not None and Path(run_dir).resolve() != folder.resolve():
            raise UserError(f"resume={str(resume)!r} and run_dir={str(run_dir)!r} name two folders: resume names the "
                            f"run it continues, and writes there; pass resume= alone")
    problem = session.agree(_not_resumable(folder) if session.is_writer else None)
    if problem:
        raise UserError(problem)
    return FitRun(folder, True)


def _new_folder(path: Path, session: Session) -> Path:
    if session.agree(path.is_dir() and any(path.iterdir())):
        raise UserError(f"run folder {path} already holds a run: continue it with resume={str(path)!r}, pass "
                        f"another run_dir=, or delete the folder to start again")
    return path


def _not_resumable(folder: Path) -> str | None:
    if not folder.is_dir():
        return f"resume={str(folder)!r} is not a folder: pass the run_dir= of the fit to continue"
    config = folder / "config.toml"
    if not config.is_file() or config.is_symlink():
        return (f"{folder} is not a fit's run folder (it has no config.toml): pass the run_dir= of the fit to "
                f"continue")
    if not complete_checkpoints(folder / "checkpoints"):
        return (f"nothing to resume: {folder / 'checkpoints'} holds no complete checkpoint (the run stopped before "
                f"its first save): start it again with run_dir= in a new folder, and checkpoint_every= to save on "
                f"the way")
    return None


def fit_table(cfg: Config, model: nn.Module, session: Session, data_kind: str) -> dict:
    """The `[fit]` table of config.toml: what a resumed fit must match (the samples per batch: fit's
    batch_size, or what an iterable's batches hold), and what it trained."""
    return {"batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum, "seed": cfg.run.seed,
            "processes": session.dp[1], "data": data_kind, "model": module_fingerprint(model)["name"]}


def write_config(folder: Path | None, cfg: Config, table: dict, session: Session) -> None:
    """config.toml as a recipe's, without the sections a fit has no use for, and with its `[fit]` table."""
    if folder is None or not session.is_writer:
        return
    data = {k: v for k, v in to_dict(cfg).items() if k not in ("model", "data", "sample")}
    (folder / "config.toml").write_text(dump_toml({**data, "fit": table}))


def check_same_run(folder: Path, table: dict, session: Session) -> None:
    """A resumed fit repeats what the run trained on, or hears what differs (one line, every rank)."""
    problem = session.agree(_differences(folder, table) if session.is_writer else None)
    if problem:
        raise UserError(problem)


def _differences(folder: Path, table: dict) -> str | None:
    try:
        saved = tomllib.loads((folder / "config.toml").read_text(encoding="utf8")).get("fit")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return f"{folder / 'config.toml'} cannot be read ({str(e).splitlines()[0]}): it is not as fit wrote it"
    if not isinstance(saved, dict):
        return (f"{folder} holds a recipe's run, not a fit's (its config.toml has no [fit] table): continue it "
                f"with gpudl train --resume {shlex.quote(str(folder))}")
    differ = [k for k in MUST_MATCH if saved.get(k) != table[k]]
    if not differ:
        return None
    then = ", ".join(f"{k}={saved.get(k)!r}" for k in differ)
    now = ", ".join(f"{k}={table[k]!r}" for k in differ)
    return (f"fit(resume={str(folder)!r}) continues a run that had {then}, but this call has {now}: pass what the "
            f"run had (with as many processes), or start a new run in another run_dir")


def checkpointer(run: FitRun, fingerprint: dict, keep: int, session: Session) -> Checkpointer | None:
    """The run's checkpoint store (the recipes' own), in a folder made and probed now; None without a folder."""
    if run.folder is None:
        return None
    prepare_run_dir(run.folder, session)
    return Checkpointer(run.folder / "checkpoints", keep, fingerprint, is_writer=session.is_writer)


def restore(ckpt: Checkpointer, job: Job, cfg: Config, session: Session) -> TrainState:
    """The newest checkpoint into `job` (weights, optimizer, schedule, loss scale, RNG), after a check
    that it holds this model that names what differs."""
    problem = None
    if session.is_writer:
        try:
            problem = _other_model(ckpt)
        except UserError as e:  # a damaged state.json: every rank must hear it, not only this one
            problem = str(e)
    problem = session.agree(problem)
    if problem:
        raise UserError(problem)
    state, _ = restore_job(ckpt, job, cfg, session.world)  # no re-seeding note: check_same_run kept the processes
    return state


def _other_model(ckpt: Checkpointer) -> str | None:
    """What makes the newest checkpoint's model another than this one, in words (None: the same). Only
    state.json's JSON is read here; the store verifies the whole checkpoint as it loads it."""
    path = ckpt.latest()
    state = read_json(path, "state.json") if path is not None else None
    theirs = state.get("model") if isinstance(state, dict) else None
    ours = ckpt.fingerprint
    if not isinstance(theirs, dict) or theirs == ours:
        return None  # the same, or not the store's format: the store says what is wrong with it
    fix = "pass the model the run trained (same class and shapes), or start a new run in another run_dir"
    if theirs.get("name") != ours["name"]:
        return f"checkpoint {path} holds a {theirs.get('name')}, but fit got a {ours['name']}: {fix}"
    saved, now = theirs.get("parameters") or {}, ours["parameters"]
    for name in [*now, *saved]:
        if saved.get(name) != now.get(name):
            return (f"checkpoint {path} holds another {ours['name']}: parameter {name!r} is "
                    f"{saved.get(name, 'absent')} there and {now.get(name, 'absent')} here: {fix}")
    return f"checkpoint {path} holds another model than fit got: {fix}"


def say_stopped(console: Console, state: TrainState, cfg: Config, summary: dict, run: FitRun) -> None:
    """After a stop request: where the work is, and the call that continues it."""
    if run.folder is None:
        console.print(f"Stopped at step {state.step} of {cfg.train.max_steps} by {summary['stopped_by']}; nothing "
                      f"saved (fit had no run_dir=): pass run_dir= to keep a run's work", markup=False, soft_wrap=True)
        return
    console.print(f"Stopped at step {state.step} of {cfg.train.max_steps} by {summary['stopped_by']}; checkpoint "
                  f"saved. Resume with: gpudl.fit(model, train_data, ..., resume={str(run.folder)!r}), the same "
                  f"model, data and settings", markup=False, soft_wrap=True)
