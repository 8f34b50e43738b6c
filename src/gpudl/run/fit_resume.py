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
from pathlib import Path

from torch import nn

from ..checkpoint import Checkpointer
from ..checkpoint.files import read_json
from ..config import Config
from ..config.settings import dump_toml, to_dict
from ..training.loop import Job, TrainState
from .run_dir import restore_job
from ..distributed.session import Session

# What a resumed fit must repeat, in the words of fit's keywords.
MUST_MATCH = ("batch_size", "grad_accum", "seed", "processes", "data")


def module_fingerprint(model: nn.Module) -> dict:
    """What identifies a user's module for resuming: its class, and its parameters' names, dtypes and shapes."""
    cls = type(model)
    return {"name": f"{cls.__module__}.{cls.__qualname__}",
            "parameters": {name: f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
                           for name, p in model.named_parameters()}}


def fit_table(cfg: Config, model: nn.Module, session: Session, data_kind: str) -> dict:
    """The `[fit]` table of config.toml: what a resumed fit must match (the samples per batch: fit's
    batch_size, or what an iterable's batches hold), and what it trained."""
    return {"batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum, "seed": cfg.run.seed,
            "processes": session.dp[1], "data": data_kind, "model": module_fingerprint(model)["name"]}


def fit_toml(cfg: Config, table: dict) -> str:
    """config.toml as a recipe's, without the sections a fit has no use for, and with its `[fit]` table."""
    data = {k: v for k, v in to_dict(cfg).items() if k not in ("model", "data", "sample")}
    return dump_toml({**data, "fit": table})


def check_same_run(folder: Path, table: dict, session: Session) -> None:
    """A resumed fit repeats what the run trained on, or hears what differs (one line, every rank)."""
    session.refuse(lambda: _differences(folder, table))


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


def restore(ckpt: Checkpointer, job: Job, cfg: Config, session: Session) -> tuple[TrainState, None]:
    """The newest checkpoint into `job` (weights, optimizer, schedule, loss scale, RNG), after a check
    that it holds this model that names what differs."""
    session.refuse(lambda: _other_model(ckpt))  # a damaged state.json too: every rank must hear it
    state, _ = restore_job(ckpt, job, cfg, session.world)  # no re-seeding note: check_same_run kept the processes
    return state, None


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


def resume_call(folder: Path | None) -> str:
    """How a stopped fit continues, for `stages.stopped_line`."""
    if folder is None:
        return "pass run_dir= to keep a run's work"
    return f"gpudl.fit(model, train_data, ..., resume={str(folder)!r}), the same model, data and settings"


def leave_model(model: nn.Module, placed: nn.Module, folder: Path, session: Session, console,
                serving: tuple = (None, "")) -> Path | None:
    """What a finished fit leaves for other tools in its folder: a Hugging Face model's own `save_pretrained`
    folder (`model/`, which `from_pretrained` loads), any other module's weights as `model.safetensors` and,
    where the exporter takes it, `model.onnx` for `gpudl serve` (fit_onnx.py; `serving` is
    fit_onnx.serving_input's (input, why not) of a training batch).
    `placed` is the module as trained (wrapped by DDP or sharded by FSDP); its whole state is gathered on
    every rank (a collective) and written by rank 0. Returns what was written (None on other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(placed, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not session.is_writer:
        return None
    if hasattr(model, "save_pretrained"):  # transformers' own layout, config included
        out = folder / "model"
        model.save_pretrained(out, state_dict=whole, safe_serialization=True)
    else:
        from ..checkpoint import export_safetensors
        from .fit_onnx import leave_onnx

        name = module_fingerprint(model)["name"]
        out = export_safetensors(model, folder / "model.safetensors", {"gpudl_fit_model": name}, state=whole)
        console.print(f"Model: {out}", markup=False)
        leave_onnx(model, *serving, folder, name, console)
        return out
    console.print(f"Model: {out}", markup=False)
    return out

