"""`gpudl train --nproc-per-node N`: check the job once, then start the workers through torchrun's own launcher.

This process becomes torchrun's agent (`torch.distributed.run`), which starts N workers that
run `python -m gpudl train ...` with RANK, WORLD_SIZE, LOCAL_RANK set, restarts the whole group
up to `--max-restarts` times when a worker dies, and handles multi-node rendezvous. Every
worker runs with one fixed run name and `--resume auto`, so a restarted group continues from
the newest checkpoint by itself. Under a scheduler that starts one launcher per node (SLURM,
Kubeflow's PyTorchJob, a JobSet, SkyPilot) the node count, node rank and rendezvous endpoint come
from its variables (placement.py). Everything that can be wrong with
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
from dataclasses import dataclass, replace

from rich.console import Console

from ..checkpoint.files import complete_checkpoints, step_of
from ..config import Config
from ..device import available, detect
from ..errors import UserError
from ..distributed.addresses import address_towards, interface_of, is_local
from ..distributed.parallelize import check_compile
from ..distributed.preflight import check_job
from .placement import DEFAULT_PORT, Placement, placement_from
from .stuck import SLACK_S as STUCK_SLACK_S, StuckAgentWatch

# How long a node waits for the rendezvous endpoint to answer before giving up with a clear error.
RENDEZVOUS_WAIT_S = 120


@dataclass(frozen=True)
class LaunchArgs:
    nproc_per_node: int
    nnodes: int = 1  # with max_nnodes: the fewest nodes the job runs on
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    # How long the nodes wait for each other at a rendezvous, the first and each after a failure
    # (parallel.timeout_s: as long as a collective waits for a rank)
    join_timeout_s: int = RENDEZVOUS_WAIT_S
    # Elastic (--nnodes MIN:MAX): up to this many nodes train together, and when one is lost the job
    # goes on, from the newest checkpoint, while nnodes remain. None: exactly nnodes.
    max_nnodes: int | None = None

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def nodes(self) -> str:
        """--nnodes as torchrun takes it: "2", or "2:3" for an elastic job."""
        return f"{self.nnodes}:{self.max_nnodes}" if self.elastic else str(self.nnodes)

    @property
    def elastic(self) -> bool:
        return self.max_nnodes not in (None, self.nnodes)

    @property
    def several(self) -> bool:
        """Whether the job may span more than one node."""
        return max(self.nnodes, self.max_nnodes or 0) > 1


def node_range(text: str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX (elastic), as (fewest, most)."""
    least, colon, most = text.partition(":")
    try:
        low, high = int(least), int(most if colon else least)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise ValueError(f"--nnodes {text!r}: give a node count (2) or an elastic range MIN:MAX with "
                         f"1 <= MIN <= MAX (2:3)")
    return low, high


def from_scheduler(args: LaunchArgs, environ: Mapping[str, str]) -> LaunchArgs:
    """Fill what the user left out (nodes, node rank, rendezvous endpoint) from the variables of the scheduler
    that started this node; flags win. With --nnodes the flags describe the job, and nothing is read."""
    if args.several:
        return args
    return _filled(args, placement_from(environ))


from_slurm = from_scheduler  # its name from before Kubernetes' and SkyPilot's variables were read too


def _filled(args: LaunchArgs, found: Placement | None) -> LaunchArgs:
    if found is None or max(found.nnodes, found.max_nnodes or 0) == 1:  # one node: standalone, as without a scheduler
        return args
    rank = found.node_rank if args.node_rank is None else args.node_rank
    return replace(args, nnodes=found.nnodes, max_nnodes=found.max_nnodes, node_rank=rank,
                   rdzv_endpoint=args.rdzv_endpoint or found.rdzv_endpoint)


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--rdzv-endpoint {endpoint!r} must be host:port, e.g. node0:{DEFAULT_PORT}")
    return host, int(port)


def wait_for_endpoint(endpoint: str, wait_s: float = RENDEZVOUS_WAIT_S) -> None:
    """Fail with a clear line, instead of hanging, when another node's endpoint never answers."""
    host, port = _split_endpoint(endpoint)
    if is_local(host):
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
    if not args.several and not args.rdzv_endpoint:
        argv.append("--standalone")
    elif args.node_rank is not None:  # fixed node ranks (check_sizes: never with an elastic range): static rendezvous at node 0's address
        host, port = _split_endpoint(args.rdzv_endpoint or f"localhost:{DEFAULT_PORT}")
        argv += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--rdzv-backend", "static",
                 "--master-addr", host, "--master-port", str(port)]
    else:  # elastic: nodes join in any order and get their ranks from the rendezvous
        host, port = _split_endpoint(args.rdzv_endpoint)
        argv += ["--nnodes", args.nodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
                 "--rdzv-id", "gpudl", "--rdzv-conf", _rdzv_conf(args, host)]
        # The address the other nodes reach this one at (torch would publish its hostname, which they
        # may not resolve, or resolve to another network)
        mine = address_towards(host, port) if args.several else None
        argv += ["--local-addr", mine] if mine else []
    return [*argv, "-m", "gpudl", *worker_argv]


def _rdzv_conf(args: LaunchArgs, host: str) -> str:
    """The c10d rendezvous's settings, scaled to the join timeout so that the nodes left after a loss
    meet again within it. A round that completed ends only when its last participant has left, a dead
    node by missing keep_alive_max_attempt heartbeats (torch: 3 of one every 5 s); then an elastic
    job's rendezvous, once MIN nodes are there, waits last_call_timeout for more (torch's 30 s; a node
    later than that joins at the next restart). Both at most a third of the join timeout."""
    third = max(1, args.join_timeout_s // 3)
    conf = f"join_timeout={args.join_timeout_s},keep_alive_interval={max(1, min(5, third // 3))}," \
           f"keep_alive_max_attempt=3"
    conf += f",last_call_timeout={min(30, third)}" if args.elastic else ""
    return conf + _is_host(host)


def _is_host(host: str) -> str:
    """",is_host=..." where torch's guess at whether this node serves the rendezvous would be wrong, else "".

    torch guesses from the hostname; on hosts that share one, or whose name resolves elsewhere, the
    node that is the endpoint guesses "not me" and every node waits for a server nobody starts. Where
    its guess is right it is left to make: a node that guessed "me" and finds the port taken (two
    agents on one machine) then joins as a client, which a forced value would not do."""
    mine = is_local(host)
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
        if _matches_machine_hostname(host) == mine:
            return ""
    except ImportError:  # a torch without it: say it always
        pass
    except OSError:  # this machine's own name does not resolve: torch's guess would fail outright
        pass
    return f",is_host={str(mine).lower()}"


def launch(args: LaunchArgs, worker_argv: list[str]) -> int:
    """Run the job; returns the exit status (a failed worker's, or 1)."""
    import torch
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import get_args_parser, run

    from ..device.peak import measure_cpu_peaks_for_workers

    if args.rdzv_endpoint and args.several:
        wait_for_endpoint(args.rdzv_endpoint)
        _gloo_on_the_jobs_network(args.rdzv_endpoint)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    if not torch.accelerator.is_available():  # the workers train on the CPU
        measure_cpu_peaks_for_workers(int(os.environ["OMP_NUM_THREADS"]))
    if args.rdzv_endpoint and args.several:  # an agent that cannot reach the endpoint's host ends too
        StuckAgentWatch(args.join_timeout_s + STUCK_SLACK_S, args.rdzv_endpoint).start()
    try:
        run(get_args_parser().parse_args(torchrun_argv(args, worker_argv)))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c == 2), codes[0] if codes else 1)
    except SignalException as e:  # SIGINT/SIGTERM: the agent passed it on and waited for the workers to save
        return 128 + e.sigval
    except RendezvousTimeoutError as e:
        raise NodesMissing(f"the job's {args.nodes} nodes were not all there within {args.join_timeout_s} s "
                           f"(parallel.timeout_s): a node did not start, or one stopped and none took its place") from e
    return 0


class NodesMissing(UserError):
    """A rendezvous (the first, or one after a failure) that did not gather every node in time."""


def _gloo_on_the_jobs_network(endpoint: str) -> None:
    """Gloo's workers find their own address from the hostname and fall back to loopback where it does
    not resolve: name the interface that reaches the endpoint instead, unless the user has."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    mine = address_towards(*_split_endpoint(endpoint))
    interface = interface_of(mine) if mine else None
    if interface and interface != "lo":
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def check_sizes(la: LaunchArgs) -> None:
    if la.nproc_per_node < 1 or la.nnodes < 1 or la.max_restarts < 0:
        raise UserError("--nproc-per-node and --nnodes must be >= 1 and --max-restarts >= 0")
    if la.elastic and la.node_rank is not None:
        raise UserError(f"--nnodes {la.nodes} (elastic) gives nodes their ranks as they join: leave out --node-rank "
                        f"(and SLURM's fixed ranks), or give a fixed --nnodes")


def worlds(la: LaunchArgs) -> list[int]:
    """Every world size the job may run at: one, or one per node count of an elastic range."""
    return [la.nproc_per_node * n for n in range(la.nnodes, (la.max_nnodes or la.nnodes) + 1)]


def _check(cfg: Config, la: LaunchArgs) -> None:
    """The job's own checks (as each worker makes them), and the processes against this machine's devices."""
    check_sizes(la)
    from ..training.precision import make_precision

    info = detect(cfg.run.device)
    for world in worlds(la):  # an elastic job: the layout must hold at each size it may shrink or grow to
        check_job(cfg, world, make_precision(cfg.train.precision, info).name)
        check_compile(cfg.train.compile, info.type, world, cfg.parallel, cfg.train.activation_checkpointing)
    if info.type != "cpu" and la.nproc_per_node > info.count:
        raise UserError(f"--nproc-per-node {la.nproc_per_node} asks for more processes than this machine's "
                        f"{info.count} {info.kind} device(s): use --nproc-per-node {info.count}")


def _worker_argv(args, run_dir: Path) -> list[str]:
    """What each worker runs: the user's own settings, and one run folder for every worker and restart."""
    argv = ["train"] + (["--debug"] if args.debug else [])
    if args.resume and args.resume != "auto":  # the run's own config.toml, changed only by --set, --device, ...
        where = ["--resume", str(run_dir)]
    else:  # "auto" continues run.name's folder once it has a checkpoint (after a restart, or a requeued job)
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
    """What a node's launcher says when its job ended early: the checkpoint to resume from, and how."""
    why = f"Stopped by {signal.Signals(code - 128).name}" if code > 128 else "The job failed (above)"
    return f"{why}: {_resume_line(run_dir, la)}"


def _resume_line(run_dir: Path, la: LaunchArgs) -> str:
    newest = complete_checkpoints(run_dir / "checkpoints")
    saved = f"the newest checkpoint is step {step_of(newest[-1])}" if newest else "no checkpoint was saved"
    nodes = ["--nnodes", la.nodes, *(["--rdzv-endpoint", la.rdzv_endpoint] if la.rdzv_endpoint else [])] \
        if la.several else []
    again = shlex.join(["gpudl", "train", "--nproc-per-node", str(la.nproc_per_node), *nodes, "--resume", str(run_dir)])
    return f"{saved}. Resume with: {again}" + (" (on every node)" if la.several else "")


def fresh_run_name(cfg: Config) -> str:
    """The folder name of a new run that has no run.name: <model>-<date>-<time>."""
    return f"{cfg.model.name}-{datetime.now():%Y%m%d-%H%M%S}"


def _run_folder(args, cfg: Config, la: LaunchArgs) -> Path:
    """The one folder every node and restart writes. --resume auto: run.name's folder, continued where it
    holds a checkpoint and started where not (so a requeued job and its first start run one command)."""
    if args.resume and args.resume != "auto":
        if not complete_checkpoints(Path(args.resume) / "checkpoints"):
            raise UserError(f"nothing to resume: {Path(args.resume) / 'checkpoints'} holds no complete checkpoint; "
                            f"start a new run instead")
        return Path(args.resume)
    if cfg.run.name:
        run_dir = Path(cfg.run.dir) / cfg.run.name
    elif la.several:
        raise UserError("a job over several machines needs one run name on all of them: add --set run.name=NAME")
    else:
        run_dir = Path(cfg.run.dir) / fresh_run_name(cfg)
    if not args.resume and (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise UserError(f"run folder {run_dir} already holds a run: continue it with --resume {run_dir}, "
                        f"or choose another --set run.name=...")
    return run_dir


def asked_for(args) -> LaunchArgs:
    """The job as `gpudl train`'s flags describe it, before the scheduler's variables fill it in."""
    least, most = args.nnodes
    return LaunchArgs(args.nproc_per_node or 1, least, args.node_rank, args.rdzv_endpoint, args.max_restarts,
                      max_nnodes=most if most != least else None)


def launch_training(args, cfg: Config, console: Console) -> int:
    la = replace(from_scheduler(asked_for(args), os.environ), join_timeout_s=cfg.parallel.timeout_s)
    _check(cfg, la)
    run_dir = _run_folder(args, cfg, la)
    console.print(f"Launching {la.nproc_per_node} process(es) per node x {la.nodes} node(s) "
                  f"on {available()[0] if cfg.run.device == 'auto' else cfg.run.device}; run folder {run_dir}")
    try:
        code = launch(la, _worker_argv(args, run_dir))
    except NodesMissing as e:
        raise NodesMissing(f"{e}; {_resume_line(run_dir, la)}") from e
    if code > 128 or (code != 0 and la.several):  # on one node, a failed worker's own line says it all
        console.print(_stopped(code, run_dir, la), markup=False, soft_wrap=True)
    return code
