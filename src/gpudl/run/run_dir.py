"""The run folder: which one a run writes to, resuming from it, and what a run leaves there after training."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from .. import models
from ..checkpoint import Checkpointer, complete_checkpoints, export_safetensors
from ..checkpoint.files import check_like
from ..checkpoint.streams import rng_note
from ..config import Config
from ..data.tokenizer import Tokenizer, run_tokenizer
from ..errors import UserError
from ..training.loop import Job, TrainState
from ..distributed.agree import ranks_where
from ..distributed.session import Session

# A run samples from the whole model on rank 0's device only if it takes at most this share of it.
SAMPLE_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class Words:
    """How a run's messages name its options: the command line's (`CLI`) or fit's keywords (`FIT`)."""

    resume: Callable[[Path], str]  # the option that continues the run in a folder
    another: str                   # how to choose another folder
    auto_needs: str                # resume "auto" without a folder every attempt shares
    start_again: str               # where a folder holds nothing to resume


CLI = Words(lambda p: f"--resume {p}", "choose another --set run.name=...",
            "--resume auto needs a run name that every attempt shares: set --set run.name=...",
            "start a new run instead")
FIT = Words(lambda p: f"resume={str(p)!r}", "pass another run_dir=",
            "resume='auto' continues run_dir when it holds a checkpoint and starts it otherwise: pass run_dir= too",
            "start it again with run_dir= in a new folder, and checkpoint_every= to save on the way")


@dataclass
class RunFolder:
    """Where a run writes (None: nowhere) and whether it continues the run there."""

    folder: Path | None
    resuming: bool = False


def resolve_run(wanted: Path | None, resume: str | Path | None, session: Session, words: Words) -> RunFolder:
    """The run folder, the same on every rank, checked (on rank 0) before anything is trained or written.

    resume=None: `wanted`, which must not hold a run (None: the run writes nothing); a path: the run
    there, which must have a checkpoint; "auto": `wanted`, resumed when it has a checkpoint, else
    started (a restarted job's first attempt may have died before its first checkpoint)."""
    if resume is None:
        if wanted is not None:
            session.refuse(lambda: _holds_a_run(wanted, words))
            prepare_run_dir(wanted, session)
        return RunFolder(wanted)
    if resume == "auto":
        if wanted is None:
            raise UserError(words.auto_needs)
        if not session.agree(bool(complete_checkpoints(wanted / "checkpoints"))):
            prepare_run_dir(wanted, session)
            return RunFolder(wanted)
        folder = wanted
    else:
        folder = Path(resume)
    session.refuse(lambda: _not_resumable(folder, words))
    prepare_run_dir(folder, session)
    return RunFolder(folder, True)


def _holds_a_run(path: Path, words: Words) -> str | None:
    if path.is_dir() and any(path.iterdir()):
        return (f"run folder {path} already holds a run: continue it with {words.resume(path)}, {words.another}, "
                f"or delete the folder to start again")
    return None


def _not_resumable(folder: Path, words: Words) -> str | None:
    if not folder.is_dir():
        return f"{words.resume(folder)} is not a folder: name the folder of the run to continue"
    config = folder / "config.toml"
    if not config.is_file() or config.is_symlink():
        return f"{folder} is not a run folder (it has no config.toml): name the folder of the run to continue"
    if not complete_checkpoints(folder / "checkpoints"):
        return (f"nothing to resume: {folder / 'checkpoints'} holds no complete checkpoint (the run stopped before "
                f"its first save): {words.start_again}")
    return None


def recipe_folder(cfg: Config, session: Session) -> Path:
    """A recipe's run folder: run.dir/run.name, the name made of the model and the time when not set."""
    return Path(cfg.run.dir) / session.agree(cfg.run.name or f"{cfg.model.name}-{datetime.now():%Y%m%d-%H%M%S}")


def resumed_folder(cfg: Config, resume: str | Path | None) -> Path | None:
    """The folder of the run `resume` continues from a checkpoint; None where a run starts."""
    if resume == "auto":
        run_dir = Path(cfg.run.dir) / (cfg.run.name or "")
        return run_dir if cfg.run.name and complete_checkpoints(run_dir / "checkpoints") else None
    return Path(resume) if resume is not None else None


def kept_tokenizer(cfg: Config, resume: str | Path | None) -> Tokenizer | None:
    """The tokenizer of the run being continued (its tokenizer.json, else bytes): a resumed run reads
    its text as it began, never through a tokenizer trained again; None for a new run."""
    folder = resumed_folder(cfg, resume)
    return run_tokenizer(folder) if folder is not None else None


def keep_tokenizer(run_dir: Path, tokenizer: Tokenizer | None) -> None:
    """Write the run's tokenizer.json beside its config.toml (bytes need none); rank 0 calls it."""
    if tokenizer is not None:
        tokenizer.save(run_dir)


def prepare_run_dir(run_dir: Path, session: Session) -> None:
    """Create the run folder (on rank 0) and write a probe file in it: a place that cannot hold a run
    fails now, in one line, on every rank; so does a folder that is not the same one on every node."""
    session.refuse(lambda: _probe(run_dir))
    if session.world > 1:
        _check_shared(run_dir, session)


def _check_shared(run_dir: Path, session: Session) -> None:
    """Every rank reads what rank 0 just wrote in the run folder. Each rank writes its share of every
    checkpoint there and a restarted job reads them all back: a node whose run.dir is a folder of its
    own (a local disk, a mount the others lack) would lose its shares at the first restart."""
    mark = run_dir / ".gpudl-shared"
    token = session.decided(lambda: _write_mark(mark))
    try:
        blind = mark.read_text() != token
    except OSError:
        blind = True
    missing = ranks_where(blind, session.control)
    if session.is_writer:
        mark.unlink(missing_ok=True)
    if missing:
        ranks = ", ".join(map(str, missing))
        here = f" (this is rank {session.rank}, on {socket.gethostname()})" if blind else ""
        raise UserError(f"run.dir is not shared: rank(s) {ranks} do not see {run_dir} as rank 0 wrote it{here}. "
                        f"Every node must mount the same folder there: set run.dir to a shared filesystem "
                        f"(NFS, Lustre, a cluster's home or scratch)")


def _write_mark(mark: Path) -> str:
    token = os.urandom(8).hex()
    mark.write_text(token)
    return token


def _probe(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".gpudl-probe-{os.getpid()}"
        probe.write_bytes(b"gpudl")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write the run folder {run_dir} ({e.strerror or e}): "
                        f"set run.dir to a folder you can write") from e


def _full_model_on(spec: models.ModelSpec, ckpt: Checkpointer, device: torch.device) -> nn.Module:
    """The whole model, in this process alone, with the newest checkpoint's weights."""
    model = models.build_to_load(spec, device)
    ckpt.load(ckpt.latest(), model, optimizer=None, no_dist=True)
    return model.eval()


def after_training(cfg: Config, spec: models.ModelSpec, model: nn.Module, ckpt: Checkpointer, session: Session,
                   run_dir: Path, console: Console, tokenizer: Tokenizer | None = None) -> None:
    """Export the weights and, for a GPT, write a sample through `tokenizer` (default: the run
    folder's, as `gpudl generate` reads it): on rank 0 only."""
    if session.world > 1:
        dist.barrier()  # the final checkpoint is complete on every rank
    if not session.is_writer:
        return
    wants_sample = spec.is_language_model and cfg.sample.tokens
    if not (cfg.checkpoint.export or wants_sample):
        return
    if session.mesh is not None:  # the weights are FSDP's shards (even of one process): read the whole model back
        model = _full_model_on(spec, ckpt, torch.device("cpu"))
    if cfg.checkpoint.export:
        _export(model, spec, run_dir, console)
    if wants_sample:
        _sample(model, cfg, session, run_dir, console, tokenizer or run_tokenizer(run_dir))


def _export(model: nn.Module, spec: models.ModelSpec, run_dir: Path, console: Console) -> None:
    try:
        path = export_safetensors(model, run_dir / "model.safetensors",
                                  {"gpudl_model": spec.name, "config": json.dumps(dataclasses.asdict(spec.config))})
        console.print(f"Weights: {path}")
    except UserError as e:
        console.print(f"Weights not exported: {e}", markup=False)


def _sample(model: nn.Module, cfg: Config, session: Session, run_dir: Path, console: Console,
            tokenizer: Tokenizer) -> None:
    from .sample import UnknownToken, sample_text

    device = session.device
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.memory_bytes and size <= SAMPLE_MEMORY_SHARE * device.memory_bytes:
        model = model.to(device.torch_device)
    t0 = time.perf_counter()
    try:
        text = sample_text(model, cfg.sample.prompt, cfg.sample.tokens, cfg.sample.temperature, cfg.sample.top_k,
                           seed=cfg.run.seed, tokenizer=tokenizer)
    except UnknownToken as e:  # the run is trained all the same: say so and go on
        console.print(f"No sample: {e}", markup=False)
        return
    (run_dir / "sample.txt").write_text(text)
    console.print(f"Sample ({time.perf_counter() - t0:.1f}s), also in {run_dir / 'sample.txt'}:")
    console.print(text, markup=False, highlight=False)


def _follow_config_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, peak_lr: float) -> None:
    """The schedule goes on from where it was, but at the config's peak lr: a resumed run's
    `--set optim.lr=...` takes effect (the restored state would keep the old one). Unchanged,
    the lr is computed exactly as the schedule computed it, so resuming stays bit-identical."""
    scheduler.base_lrs = [peak_lr] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = peak_lr
        group["lr"] = peak_lr * factor(scheduler.last_epoch)


def restore_job(ckpt: Checkpointer, job: Job, cfg: Config, world: int) -> tuple[TrainState, str | None]:
    """Load the newest checkpoint into `job`: weights, optimizer, schedule, loss scale, RNG; the loop's state,
    and a line to print when the checkpoint was saved by another number of processes (its RNG re-seeded)."""
    path = ckpt.latest()
    if path is None:
        raise UserError(f"nothing to resume: {ckpt.folder} holds no complete checkpoint; start a new run instead")
    extra = ckpt.load(path, job.model, job.optimizer, seed=cfg.run.seed)
    job.scheduler.load_state_dict(check_like(path, "scheduler", extra.get("scheduler"), job.scheduler.state_dict()))
    _follow_config_lr(job.scheduler, cfg.optim.lr)
    scaler, live = extra.get("scaler", {}), job.precision.state_dict()
    job.precision.load_state_dict(check_like(path, "scaler", scaler, live) if scaler and live else {})
    return TrainState(**extra["train_state"]), rng_note(extra["world_size"], world)
