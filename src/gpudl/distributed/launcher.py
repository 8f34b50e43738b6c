"""Check a multi-process training job before any process starts, then hand it to torchrun.

Everything that can be wrong with the request (config, model, degrees against the number of
processes, processes against devices, data path, run folder) is said here in one line, once,
instead of N times by N workers - or N times per restart.
"""

from __future__ import annotations

import os
import shlex
import signal
from datetime import datetime
from pathlib import Path

from rich.console import Console

from .. import models
from ..checkpoint.files import complete_checkpoints, step_of
from ..config import Config
from ..device import available, detect
from .launch import LaunchArgs, from_slurm, launch
from .mesh import ParallelDims
from ..errors import UserError


def _check(cfg: Config, la: LaunchArgs) -> None:
    models.resolve(cfg.model.name, cfg.model.overrides)
    p = cfg.parallel
    ParallelDims.resolve(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, world=la.world)
    info = detect(cfg.run.device)
    if info.type != "cpu" and la.nproc_per_node > info.count:
        raise UserError(f"--nproc-per-node {la.nproc_per_node} asks for more processes than this machine's "
                        f"{info.count} {info.kind} device(s): use --nproc-per-node {info.count}")
    if cfg.data.path and cfg.data.path != "sklearn:digits" and not Path(cfg.data.path).exists():
        raise UserError(f"data.path {cfg.data.path!r} does not exist on this machine")
    if la.nproc_per_node < 1 or la.nnodes < 1 or la.max_restarts < 0:
        raise UserError("--nproc-per-node and --nnodes must be >= 1 and --max-restarts >= 0")


def _worker_argv(args, run_dir: Path) -> list[str]:
    """What each worker runs: the user's own settings, and one run folder for every worker and restart."""
    argv = ["train"] + (["--debug"] if args.debug else [])
    if args.resume:  # the run's own config.toml, changed only by the user's --set, --device, --precision
        where = ["--resume", str(run_dir)]
    else:  # "auto" resumes the new run once it has a checkpoint (after a restart)
        where = (["--config", args.config] if args.config else []) + \
            ["--set", f"run.dir={run_dir.parent}", "--set", f"run.name={run_dir.name}", "--resume", "auto"]
    for item in args.sets:
        argv += ["--set", item]
    for flag, value in (("--device", args.device), ("--precision", args.precision)):
        if value:
            argv += [flag, value]
    return argv + where


def _stopped(code: int, run_dir: Path, la: LaunchArgs) -> str:
    newest = complete_checkpoints(run_dir / "checkpoints")
    saved = f"the newest checkpoint is step {step_of(newest[-1])}" if newest else "no checkpoint was saved"
    nodes = ["--nnodes", str(la.nnodes)] if la.nnodes > 1 else []
    again = shlex.join(["gpudl", "train", "--nproc-per-node", str(la.nproc_per_node), *nodes, "--resume", str(run_dir)])
    return f"Stopped by {signal.Signals(code - 128).name}: {saved}. Resume with: {again}"


def launch_training(args, cfg: Config, console: Console) -> int:
    la = from_slurm(LaunchArgs(args.nproc_per_node or 1, args.nnodes, args.node_rank, args.rdzv_endpoint,
                               args.max_restarts), os.environ)
    _check(cfg, la)
    if args.resume:
        run_dir = Path(args.resume)
    elif cfg.run.name:
        run_dir = Path(cfg.run.dir) / cfg.run.name
    elif la.nnodes > 1:
        raise UserError("a job over several machines needs one run name on all of them: add --set run.name=NAME")
    else:
        run_dir = Path(cfg.run.dir) / f"{cfg.model.name}-{datetime.now():%Y%m%d-%H%M%S}"
    if args.resume and not complete_checkpoints(run_dir / "checkpoints"):
        raise UserError(f"nothing to resume: {run_dir / 'checkpoints'} holds no complete checkpoint; "
                        f"start a new run instead")
    if not args.resume and (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise UserError(f"run folder {run_dir} already holds a run: continue it with --resume {run_dir}, "
                        f"or choose another --set run.name=...")
    console.print(f"Launching {la.nproc_per_node} process(es) per node x {la.nnodes} node(s) "
                  f"on {available()[0]}; run folder {run_dir}")
    code = launch(la, _worker_argv(args, run_dir))
    if code > 128:
        console.print(_stopped(code, run_dir, la), markup=False, soft_wrap=True)
    return code
