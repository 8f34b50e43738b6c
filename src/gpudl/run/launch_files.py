"""`gpudl launch --emit KIND`: the file a cluster's scheduler runs one training job from.

One function per scheduler: an sbatch script (SLURM), a JobSet or a PyTorchJob (Kubernetes) and a
SkyPilot task. Each starts one `gpudl train --nproc-per-node N` per node, with the run's fixed name
and `--resume auto`: every node writes the one run folder, and a restarted or requeued job continues
from its newest checkpoint. The command is the same on every node; the node count, node rank and
rendezvous endpoint come from the variables each scheduler sets (placement.py), which is why one
command line serves all nodes.

YAML is written as text (gpudl does not depend on a YAML library), every string JSON-quoted: a JSON
string is a YAML double-quoted scalar of the same value, whatever characters it holds.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
from pathlib import Path, PurePosixPath

from rich.console import Console

from ..config import Config
from ..errors import UserError
from .launch import LaunchArgs, check_sizes, fresh_run_name
from .placement import DEFAULT_PORT

SUBMIT = {"slurm": "sbatch", "jobset": "kubectl apply -f", "pytorchjob": "kubectl apply -f", "skypilot": "sky launch"}
# Where the shared storage holding run.dir is mounted in a pod or on a SkyPilot node, when run.dir is
# relative: a relative folder would be the container's own, gone with it.
RUNS_MOUNT = "/runs"
# What the user must name: invalid names (upper case), so that a file submitted unchanged is refused.
IMAGE = "CHANGE-ME/an-image-with-gpudl:tag"
CLAIM = "CHANGE-ME-a-shared-volume-claim"
BUCKET = "CHANGE-ME-a-bucket-name"
# device type -> (Kubernetes' resource name, a SkyPilot accelerator of that vendor); absent: no GPU asked for
GPUS = {"auto": ("nvidia.com/gpu", "H100"), "cuda": ("nvidia.com/gpu", "H100"), "rocm": ("amd.com/gpu", "MI300X")}
REPLICATED_JOB = "nodes"  # the JobSet's one replicated job: its pods are the nodes


def _q(text: str) -> str:
    return json.dumps(text)


def _gpus(cfg: Config) -> tuple[str, str] | None:
    return GPUS.get(cfg.run.device.split(":")[0])


def _runs_mount(cfg: Config) -> str:
    return cfg.run.dir if PurePosixPath(cfg.run.dir).is_absolute() else RUNS_MOUNT


def _k8s_name(run_name: str) -> str:
    """run.name as a Kubernetes object name (a DNS label: a-z, 0-9 and '-', a letter first), short enough
    that a pod's hostname, the name and a suffix such as -nodes-0-12, stays within 63 characters."""
    label = re.sub(r"^[^a-z]+", "", re.sub(r"[^a-z0-9-]+", "-", run_name.lower()))
    return label[:40].rstrip("-") or "gpudl"


def train_command(job: LaunchArgs, train_flags: list[str], run_dir: str | None = None) -> list[str]:
    """Every node's command; `run_dir` replaces run.dir where the shared storage is mounted elsewhere."""
    where = ["--set", f"run.dir={run_dir}"] if run_dir else []
    return ["gpudl", "train", "--nproc-per-node", str(job.nproc_per_node), "--max-restarts", str(job.max_restarts),
            *train_flags, *where, "--resume", "auto"]


def _shell(argv: list[str], indent: str = "    ") -> str:
    """argv as one shell command, a flag and its value per line."""
    lines: list[list[str]] = []
    for word in map(shlex.quote, argv):
        if word.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(word)
    return f" \\\n{indent}".join(" ".join(line) for line in lines)


def _header(kind: str, run_name: str, job: LaunchArgs, *notes: str) -> str:
    return "\n".join([f"# The gpudl run {run_name!r} on {job.nnodes} node(s) x {job.nproc_per_node} process(es), "
                      f"written by `gpudl launch --emit {kind}`.", f"# Submit it with: {SUBMIT[kind]} FILE",
                      *(f"# {note}" for note in notes)])


def _sbatch(cfg: Config, job: LaunchArgs, run_name: str, train_flags: list[str]) -> str:
    header = _header("slurm", run_name, job,
                     "Run sbatch in the folder you ran gpudl launch in: relative paths (--config, run.dir) start there.",
                     f"run.dir ({cfg.run.dir}) must be on a shared filesystem, one every node sees: all nodes write",
                     "the one run folder, and a requeued job finds its checkpoints there.",
                     "Add the options your cluster asks for (--partition, --time, ...) below.")
    gpus = ["# One GPU per process.", f"#SBATCH --gpus-per-node={job.nproc_per_node}"] if _gpus(cfg) else []
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_name)  # sbatch reads these lines without a shell's quoting
    options = [
        "# The job's name in squeue: the run's.", f"#SBATCH --job-name={label}",
        "# The machines.", f"#SBATCH --nodes={job.nnodes}",
        "# One gpudl launcher per node; it starts --nproc-per-node processes itself (torchrun's agent).",
        "#SBATCH --ntasks-per-node=1", *gpus,
        "# 90 s before the time limit, USR1 to this script (B:), whose trap below stops the run with a checkpoint.",
        "#SBATCH --signal=B:USR1@90",
        "# The job may go back to the queue: after a node fails, or from that trap.", "#SBATCH --requeue",
        "# One log for the job and its requeued starts (they keep the job id): appended to, never truncated.",
        f"#SBATCH --output={label}-%j.out", "#SBATCH --open-mode=append"]
    command = _shell(train_command(job, train_flags)) + f' \\\n    --rdzv-endpoint "$head_node:{DEFAULT_PORT}"'
    return "\n".join(["#!/bin/bash", header, *options, "", _SLURM_BODY.format(command=command)])


_SLURM_BODY = """\
# Activate the Python environment that has gpudl here, if the nodes need one.

# Node 0, the first host of the allocation, hosts the rendezvous; each node's gpudl reads its node
# rank and the node count from SLURM (SLURM_NODEID, SLURM_NNODES).
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)

# SIGTERM makes every node's gpudl finish its step, save a checkpoint and exit; then back to the
# queue, where --resume auto continues the run. The signal goes to the job's steps through SLURM:
# srun itself, given SIGTERM, cancels its step, and the tasks are killed before they have saved.
stop_and_requeue() {{
    scancel --signal=TERM "$SLURM_JOB_ID"
    wait "$srun_pid"
    scontrol requeue "$SLURM_JOB_ID"
}}
trap stop_and_requeue USR1

# One task per node, in the background and waited for: bash holds a trap until a foreground command
# ends, but runs it at once during `wait`.
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 \\
    {command} &
srun_pid=$!
wait "$srun_pid"
"""


def _pod_spec(container: str, argv: list[str], cfg: Config, job: LaunchArgs, env: dict[str, str],
              port_name: str, restart_policy: str | None = None) -> str:
    """A pod: one container running argv, the shared volume at run.dir, /dev/shm in memory."""
    gpus = _gpus(cfg)
    lines = ["spec:", *([f"  restartPolicy: {restart_policy}"] if restart_policy else []), "  containers:",
             f"  - name: {container}",
             f"    image: {_q(IMAGE)}  # an image with gpudl and the torch for these nodes installed",
             "    command:", *(f"    - {_q(word)}" for word in argv)]
    lines += ["    env:", *(f"    - {{name: {k}, value: {_q(v)}}}" for k, v in env.items())] if env else []
    lines += ["    ports:", f"    - {{name: {port_name}, containerPort: {DEFAULT_PORT}}}  # node 0 serves the rendezvous here"]
    lines += ["    resources:", "      limits:", f"        {gpus[0]}: {job.nproc_per_node}  # one GPU per process"] \
        if gpus else []
    lines += ["    volumeMounts:", f"    - {{name: runs, mountPath: {_q(_runs_mount(cfg))}}}",
              "    - {name: shm, mountPath: /dev/shm}",
              "  volumes:",
              "  # run.dir: one volume all nodes share (ReadWriteMany), so they write one run folder and a",
              "  # restarted job finds its checkpoints",
              f"  - {{name: runs, persistentVolumeClaim: {{claimName: {_q(CLAIM)}}}}}",
              "  # data loader workers and NCCL share memory through /dev/shm, 64 MiB in a container by default",
              "  - {name: shm, emptyDir: {medium: Memory}}"]
    return "\n".join(lines) + "\n"


def _jobset(cfg: Config, job: LaunchArgs, run_name: str, train_flags: list[str]) -> str:
    name = _k8s_name(run_name)
    argv = train_command(job, train_flags, _runs_mount(cfg))
    # torchrun's own names, which gpudl reads too; Kubernetes adds JOB_COMPLETION_INDEX, the node rank
    env = {"PET_NNODES": str(job.nnodes), "PET_MASTER_ADDR": f"{name}-{REPLICATED_JOB}-0-0.{name}",
           "PET_MASTER_PORT": str(DEFAULT_PORT)}
    pod = textwrap.indent(_pod_spec("gpudl", argv, cfg, job, env, "rendezvous", "Never"), " " * 10)
    header = _header("jobset", run_name, job, "It needs the JobSet controller. Name the image and the volume claim "
                                               "(CHANGE-ME) first.")
    return f"""{header}
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: {name}
spec:
  network:
    enableDNSHostnames: true  # pod i answers as {name}-{REPLICATED_JOB}-0-i.{name}: node 0 hosts the rendezvous
  failurePolicy:
    maxRestarts: {job.max_restarts}  # a failed pod restarts all of them, this often; --resume auto continues
  replicatedJobs:
  - name: {REPLICATED_JOB}
    replicas: 1  # one Job ...
    template:
      spec:
        parallelism: {job.nnodes}  # ... of one pod per node, all running together
        completions: {job.nnodes}
        completionMode: Indexed  # each pod's JOB_COMPLETION_INDEX (0 to nodes - 1) is its node rank
        backoffLimit: 0  # a failed pod fails the Job, and the JobSet restarts every pod (failurePolicy)
        template:
{pod}"""


def _elastic_policy(name: str, job: LaunchArgs) -> str:
    """c10d rendezvous, which a restarted group forms again; only where restarts across nodes can happen
    (the operator refuses an elasticPolicy without Workers)."""
    if job.max_restarts == 0 or job.nnodes == 1:
        return ""
    return f"""  elasticPolicy:
    rdzvBackend: c10d
    rdzvHost: {name}-master-0
    rdzvPort: {DEFAULT_PORT}
    # every pod, Master included: left out, the operator counts the Workers alone
    minReplicas: {job.nnodes}
    maxReplicas: {job.nnodes}
    maxRestarts: {job.max_restarts}
"""


def _pytorchjob(cfg: Config, job: LaunchArgs, run_name: str, train_flags: list[str]) -> str:
    name = _k8s_name(run_name)
    argv = train_command(job, train_flags, _runs_mount(cfg))
    # the operator wants a container named pytorch, and takes MASTER_PORT from its port named pytorchjob-port
    pod = textwrap.indent(_pod_spec("pytorch", argv, cfg, job, {}, "pytorchjob-port"), " " * 8)
    roles = [("Master", 1)] + ([("Worker", job.nnodes - 1)] if job.nnodes > 1 else [])
    replicas = "".join(f"    {role}:\n      replicas: {count}\n      restartPolicy: OnFailure\n      template:\n{pod}"
                       for role, count in roles)
    header = _header("pytorchjob", run_name, job, "It needs Kubeflow's training operator. Name the image and the "
                                                       "volume claim (CHANGE-ME) first.")
    return f"""{header}
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: {name}
spec:
  nprocPerNode: {_q(str(job.nproc_per_node))}
  runPolicy:
    backoffLimit: {job.max_restarts}  # container restarts before the job fails; --resume auto continues
{_elastic_policy(name, job)}  pytorchReplicaSpecs:
{replicas}"""


def _skypilot(cfg: Config, job: LaunchArgs, run_name: str, train_flags: list[str]) -> str:
    gpus, runs = _gpus(cfg), _runs_mount(cfg)
    resources = f"accelerators: {_q(f'{gpus[1]}:{job.nproc_per_node}')}  # any GPU model `sky show-gpus` lists" \
        if gpus else f"cpus: {_q(f'{job.nproc_per_node}+')}"
    command = _shell(train_command(job, train_flags, runs), indent="      ")
    header = _header("skypilot", run_name, job, "Launch it from gpudl's source folder: the workdir every node gets "
                                                 "(your --config too). Name the bucket (CHANGE-ME) first.")
    return f"""{header}
name: {_q(run_name)}
num_nodes: {job.nnodes}
resources:
  {resources}
workdir: .
setup: |
  pip install .  # gpudl; install the torch for these nodes first (docs/install.md)
file_mounts:
  # run.dir: one bucket all nodes share, so they write one run folder and a restarted job finds its
  # checkpoints; MOUNT_CACHED writes to the node's disk first, SkyPilot's mode for checkpoints
  {_q(runs)}:
    name: {_q(BUCKET)}
    mode: MOUNT_CACHED
run: |
  # SkyPilot gives every node SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK and SKYPILOT_NODE_IPS (the head
  # node's first); gpudl reads them: the node count, this node's rank, the rendezvous at the head.
  echo "node $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES, head $(echo "$SKYPILOT_NODE_IPS" | head -n1), $SKYPILOT_NUM_GPUS_PER_NODE GPU(s)"
  {command}
"""


_WRITERS = {"slurm": _sbatch, "jobset": _jobset, "pytorchjob": _pytorchjob, "skypilot": _skypilot}
FILE_KINDS = tuple(_WRITERS)


def launch_file(kind: str, cfg: Config, job: LaunchArgs, train_flags: list[str]) -> str:
    """The `kind` file (one of FILE_KINDS) for this job; `train_flags` are the user's own flags to repeat,
    and a run without run.name gets one here: every node, and every start, must write the same folder."""
    name = cfg.run.name or fresh_run_name(cfg)
    named = train_flags if cfg.run.name else [*train_flags, "--set", f"run.name={name}"]
    return _WRITERS[kind](cfg, job, name, named)


def _train_flags(args) -> list[str]:
    """The user's own settings, as each node's `gpudl train` repeats them."""
    flags = ["--config", args.config] if args.config else []
    for item in args.sets:
        flags += ["--set", item]
    for flag, value in (("--device", args.device), ("--precision", args.precision)):
        flags += [flag, value] if value else []
    return flags


def emit(args, cfg: Config, console: Console) -> int:
    """`gpudl launch`: the file for `cfg` (loaded as `gpudl train` loads it), printed or written to --out."""
    if args.emit not in FILE_KINDS:
        asked = f"--emit {args.emit!r}" if args.emit else "no --emit"
        raise UserError(f"{asked}: say which file to write, one of --emit {', --emit '.join(FILE_KINDS)}")
    least, most = args.nnodes
    if least != most:
        raise UserError(f"--nnodes {least}:{most}: a launch file asks its scheduler for a fixed number of nodes; give "
                        f"--nnodes N (an elastic range is for `gpudl train` run on the nodes themselves)")
    job = LaunchArgs(args.nproc_per_node, least, max_restarts=args.max_restarts)
    check_sizes(job)
    text = launch_file(args.emit, cfg, job, _train_flags(args))
    if not args.out:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text)
    except OSError as e:
        raise UserError(f"--out {args.out!r}: cannot write it ({e.strerror or e}): choose a place you can write") from e
    console.print(f"Wrote {args.out}: submit it with {SUBMIT[args.emit]} {args.out}", markup=False, soft_wrap=True)
    return 0
