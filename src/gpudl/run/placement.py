"""Where this node stands in a job over several machines, as the scheduler that started it says.

Each scheduler starts one `gpudl train` per node and tells it, in variables of its own, how many
nodes the job has, which one this is and where they meet. One reader per scheduler turns them into
a `Placement`; `launch.from_scheduler` fills what the command line left out from it. A variable that
is there but malformed is an error naming it, never a guess: a wrong node count or rank hangs the
rendezvous instead of failing.

The variables, from each system's documentation and source:
- SLURM (`srun`, one task per node): SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST.
- torchrun's own `PET_<FLAG>` names (torchrun reads them as its flags' defaults). Kubeflow's
  PyTorchJob (training-operator 1.7 and newer, pkg/controller.v1/pytorch/envvar.go, master.go,
  elastic.go) sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, and with an
  elasticPolicy PET_RDZV_ENDPOINT and PET_NNODES as "min:max". The JobSet file `gpudl launch`
  writes sets PET_NNODES, PET_MASTER_ADDR and PET_MASTER_PORT, and Kubernetes gives each pod of an
  Indexed Job its JOB_COMPLETION_INDEX: the node rank.
- SkyPilot: SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES, SKYPILOT_NODE_IPS (one per line, the head first).
- One launcher per node given torch's plain names as node-level values: Kubeflow's PyTorchJob
  before training-operator 1.7 sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE (its pods) and RANK
  (this pod). Newer operators set them too, with WORLD_SIZE counting processes, so the PET_ names
  are read first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..distributed.env import _first_slurm_host
from ..errors import UserError

DEFAULT_PORT = 29500
_FIX = "fix or unset it, or give --nnodes, --node-rank and --rdzv-endpoint on the command line"


@dataclass(frozen=True)
class Placement:
    nnodes: int
    node_rank: int | None  # None: the rendezvous gives each node its rank as it joins (c10d)
    rdzv_endpoint: str     # host:port where the nodes meet
    max_nnodes: int | None = None  # elastic (Kubeflow's elasticPolicy min < max): up to this many nodes


def _whole(environ: Mapping[str, str], name: str, default: str | None = None, least: int = 0) -> int:
    value = environ.get(name, default)
    if value is None or not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < least:
        raise UserError(f"{name}={value!r} must be a whole number >= {least}: {_FIX}")
    return int(value)


def _endpoint(environ: Mapping[str, str], name: str) -> str:
    host, _, port = environ[name].rpartition(":")
    if not host or not re.fullmatch(r"[0-9]+", port):
        raise UserError(f"{name}={environ[name]!r} must be host:port, e.g. node0:{DEFAULT_PORT}: {_FIX}")
    return environ[name]


def _node_count(environ: Mapping[str, str], name: str) -> tuple[int, int]:
    """'4', or an elastic range '2:4' (Kubeflow's elasticPolicy minReplicas:maxReplicas), as (fewest, most)."""
    value = environ[name]
    low, colon, high = value.partition(":")
    numbers = [low, high] if colon else [low]
    if not all(re.fullmatch(r"[0-9]+", n) for n in numbers) or not 1 <= int(low) <= int(numbers[-1]):
        raise UserError(f"{name}={value!r} must be a number of nodes, e.g. 4, or a range MIN:MAX, e.g. 2:4: {_FIX}")
    return int(low), int(numbers[-1])


def _slurm(environ: Mapping[str, str]) -> Placement | None:
    """srun's one task per node: node 0 (the first host of the node list) hosts the rendezvous."""
    if "SLURM_JOB_ID" not in environ:
        return None
    host = _first_slurm_host(environ.get("SLURM_JOB_NODELIST", "localhost"))
    return Placement(_whole(environ, "SLURM_NNODES", "1", least=1), _whole(environ, "SLURM_NODEID", "0"),
                     f"{host}:{DEFAULT_PORT}")


def _torchrun_names(environ: Mapping[str, str]) -> Placement | None:
    """Kubeflow's PyTorchJob and Trainer, and the JobSet file: torchrun's PET_ names."""
    if "PET_NNODES" not in environ:
        return None
    nnodes, most = _node_count(environ, "PET_NNODES")
    if "PET_RDZV_ENDPOINT" in environ:  # an elasticPolicy: c10d, which a restarted group can form again
        return Placement(nnodes, None, _endpoint(environ, "PET_RDZV_ENDPOINT"), most if most != nnodes else None)
    if most != nnodes:
        raise UserError(f"PET_NNODES={environ['PET_NNODES']!r} is a range, which needs the c10d rendezvous: set "
                        f"PET_RDZV_ENDPOINT (an elasticPolicy does), or {_FIX}")
    if not environ.get("PET_MASTER_ADDR"):
        raise UserError("PET_NNODES is set but neither PET_RDZV_ENDPOINT nor PET_MASTER_ADDR says where the nodes "
                        f"meet: set PET_MASTER_ADDR to node 0's address, or {_FIX}")
    rank_name = next((n for n in ("PET_NODE_RANK", "JOB_COMPLETION_INDEX") if n in environ), None)
    rank = _whole(environ, rank_name) if rank_name else None
    port = _whole(environ, "PET_MASTER_PORT", str(DEFAULT_PORT), least=1)
    return Placement(nnodes, rank, f"{environ['PET_MASTER_ADDR']}:{port}")


def _skypilot(environ: Mapping[str, str]) -> Placement | None:
    if "SKYPILOT_NODE_RANK" not in environ:
        return None
    ips = environ.get("SKYPILOT_NODE_IPS", "").split()
    if not ips:
        raise UserError(f"SKYPILOT_NODE_RANK is set but SKYPILOT_NODE_IPS holds no address: {_FIX}")
    nnodes = _whole(environ, "SKYPILOT_NUM_NODES", str(len(ips)), least=1)
    return Placement(nnodes, _whole(environ, "SKYPILOT_NODE_RANK"), f"{ips[0]}:{DEFAULT_PORT}")


def _plain_names(environ: Mapping[str, str]) -> Placement | None:
    """MASTER_ADDR, WORLD_SIZE and RANK given to a launcher (never to a worker: commands.py tells them apart
    by LOCAL_RANK, which torchrun sets) count nodes, as Kubeflow's PyTorchJob before 1.7 set them."""
    if not {"MASTER_ADDR", "WORLD_SIZE", "RANK"} <= environ.keys():
        return None
    port = _whole(environ, "MASTER_PORT", str(DEFAULT_PORT), least=1)
    return Placement(_whole(environ, "WORLD_SIZE", least=1), _whole(environ, "RANK"),
                     f"{environ['MASTER_ADDR']}:{port}")


def placement_from(environ: Mapping[str, str]) -> Placement | None:
    """This node's place in the job, from the first scheduler whose variables are set; None: none is."""
    for read in (_slurm, _torchrun_names, _skypilot, _plain_names):
        found = read(environ)
        if found is not None:
            return found
    return None
