"""`gpudl train --nproc-per-node N`: check the job once, then start the workers through torchrun's own launcher.

This process becomes torchrun's agent (`torch.distributed.run`), which starts N workers that
run `python -m gpudl train ...` with RANK, WORLD_SIZE, LOCAL_RANK set, restarts the whole group
up to `--max-restarts` times when a worker dies, and handles multi-node rendezvous. Every
worker runs with one fixed run name and `--resume auto`, so a restarted group continues from
the newest checkpoint by itself. Under SLURM (`srun`, one launcher per node) the node count,
node rank and rendezvous host come from SLURM's environment. Everything that can be wrong with
the request (`preflight.check_job`, the devices, the run folder) is said here, once.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import time
from datetime import datetime
from pathlib import Path
from collections.abc import Mapping
from dataclasses import dataclass

from rich.console import Console

from ..checkpoint.files import complete_checkpoints, step_of
from ..config import Config
from ..device import available, detect
from ..errors import UserError
from ..distributed.env import _first_slurm_host
from ..distributed.parallelize import check_compile
from ..distributed.preflight import check_job

DEFAULT_PORT = 29500
# How long a node waits for the rendezvous endpoint to answer before giving up with a clear error.
RENDEZVOUS_WAIT_S = 120


@dataclass(frozen=True)
class LaunchArgs:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes


def from_slurm(args: LaunchArgs, environ: Mapping[str, str]) -> LaunchArgs:
    """Fill what the user left out from SLURM's environment (one `gpudl train` per node under srun)."""
    if "SLURM_JOB_ID" not in environ or args.nnodes > 1 or int(environ.get("SLURM_NNODES", 1)) == 1:
        return args
    host = _first_slurm_host(environ.get("SLURM_JOB_NODELIST", "localhost"))
    return LaunchArgs(args.nproc_per_node, int(environ["SLURM_NNODES"]), int(environ.get("SLURM_NODEID", 0)),
                      args.rdzv_endpoint or f"{host}:{DEFAULT_PORT}", args.max_restarts)


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--rdzv-endpoint {endpoint!r} must be host:port, e.g. node0:{DEFAULT_PORT}")
    return host, int(port)


def _is_local(host: str) -> bool:
    try:
        return host in ("localhost", "127.0.0.1", socket.gethostname()) or \
            socket.gethostbyname(host) in ("127.0.0.1", socket.gethostbyname(socket.gethostname()))
    except OSError:
        return False


def wait_for_endpoint(endpoint: str, wait_s: float = RENDEZVOUS_WAIT_S) -> None:
    """Fail with a clear line, instead of hanging, when another node's endpoint never answers."""
    host, port = _split_endpoint(endpoint)
    if _is_local(host):
        return  # this node hosts the rendezvous
    deadline, last = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=5).close()
            return
        except OSError as e:
            last = e
            time.sleep(2)
    raise UserError(f"cannot reach the rendezvous endpoint {endpoint} after {wait_s:.0f} s ({last}): start the "
                    f"node it points to first, or fix --rdzv-endpoint")


def torchrun_argv(args: LaunchArgs, worker_argv: list[str]) -> list[str]:
    """torchrun's command line for this launch; the workers run `python -m gpudl <worker_argv>`."""
    argv = ["--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts)]
    if args.nnodes == 1 and not args.rdzv_endpoint:
        argv.append("--standalone")
    elif args.node_rank is not None:  # fixed node ranks: static rendezvous at node 0's address
        host, port = _split_endpoint(args.rdzv_endpoint or f"localhost:{DEFAULT_PORT}")
        argv += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--rdzv-backend", "static",
                 "--master-addr", host, "--master-port", str(port)]
    else:  # elastic: nodes join in any order and get their ranks from the rendezvous
        argv += ["--nnodes", str(args.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
                 "--rdzv-id", "gpudl", "--rdzv-conf", f"join_timeout={RENDEZVOUS_WAIT_S}"]
    return [*argv, "-m", "gpudl", *worker_argv]


def launch(args: LaunchArgs, worker_argv: list[str]) -> int:
    """Run the job; returns the exit status (a failed worker's, or 1)."""
    import torch
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from ..device.peak import measure_cpu_peaks_for_workers

    if args.rdzv_endpoint and args.nnodes > 1:
        wait_for_endpoint(args.rdzv_endpoint)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    if not torch.accelerator.is_available():  # the workers train on the CPU
        measure_cpu_peaks_for_workers(int(os.environ["OMP_NUM_THREADS"]))
    try:
        run(get_args_parser().parse_args(torchrun_argv(args, worker_argv)))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c == 2), codes[0] if codes else 1)
    except SignalException as e:  # SIGINT/SIGTERM: the agent passed it on and waited for the workers to save
        return 128 + e.sigval
    return 0


def _check(cfg: Config, la: LaunchArgs) -> None:
    """The job's own checks (as each worker makes them), and the processes against this machine's devices."""
    if la.nproc_per_node < 1 or la.nnodes < 1 or la.max_restarts < 0:
        raise UserError("--nproc-per-node and --nnodes must be >= 1 and --max-restarts >= 0")
    from ..training.precision import make_precision

    info = detect(cfg.run.device)
    check_job(cfg, la.world, make_precision(cfg.train.precision, info).name)
    check_compile(cfg.train.compile, info.type, la.world, cfg.parallel, cfg.train.activation_checkpointing)
    if info.type != "cpu" and la.nproc_per_node > info.count:
        raise UserError(f"--nproc-per-node {la.nproc_per_node} asks for more processes than this machine's "
                        f"{info.count} {info.kind} device(s): use --nproc-per-node {info.count}")


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
    for flag, value in (("--device", args.device), ("--precision", args.precision), ("--plan", args.plan),
                        ("--memory-limit", args.memory_limit)):
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
                  f"on {available()[0] if cfg.run.device == 'auto' else cfg.run.device}; run folder {run_dir}")
    code = launch(la, _worker_argv(args, run_dir))
    if code > 128:
        console.print(_stopped(code, run_dir, la), markup=False, soft_wrap=True)
    return code
