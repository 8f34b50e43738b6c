"""`gpudl train` started on two hosts as Kubernetes (Kubeflow's PyTorchJob, a JobSet) and SkyPilot start it:
no --nnodes, --node-rank or --rdzv-endpoint, only the variables each system sets on each node (placement.py
says where each list comes from). Each makes one job of two nodes. The pod names Kubernetes' DNS would
give are these hosts' names; SkyPilot gives addresses."""

from __future__ import annotations

import json

import pytest

from hosts import Hosts, why_not_here
from runs import ENV, PORT, train_argv, wait_all

pytestmark = pytest.mark.skipif(why_not_here() is not None, reason=why_not_here() or "")


def pytorchjob(rank: int, addresses: list[str]) -> dict[str, str]:
    """training-operator 1.7+ with an elasticPolicy (minReplicas = maxReplicas = 2, maxRestarts 1): every
    pod gets the same rendezvous endpoint and node range; ranks come from the rendezvous. MASTER_ADDR,
    WORLD_SIZE and RANK are set too (WORLD_SIZE counting processes), and must lose to the PET_ names."""
    return {"PET_RDZV_ENDPOINT": f"host0:{PORT}", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2:2",
            "PET_NPROC_PER_NODE": "1", "PET_MAX_RESTARTS": "1", "MASTER_ADDR": "host0", "MASTER_PORT": str(PORT),
            "WORLD_SIZE": "2", "RANK": str(rank)}


def jobset(rank: int, addresses: list[str]) -> dict[str, str]:
    """The JobSet file `gpudl launch --emit jobset` writes: PET_ names in the pod spec, and the Indexed
    Job's JOB_COMPLETION_INDEX, the node rank."""
    return {"PET_NNODES": "2", "PET_MASTER_ADDR": "host0", "PET_MASTER_PORT": str(PORT),
            "JOB_COMPLETION_INDEX": str(rank)}


def skypilot(rank: int, addresses: list[str]) -> dict[str, str]:
    """SkyPilot's "Distributed multi-node jobs" variables: the head's address first, one per line."""
    return {"SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "\n".join(addresses) + "\n",
            "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": f"sky-test_{rank}"}


@pytest.mark.parametrize("variables", [pytorchjob, jobset, skypilot])
def test_a_schedulers_variables_make_one_job_of_two_nodes(variables, tmp_path):
    run_dir = tmp_path / "run"
    argv = train_argv(run_dir, "--nproc-per-node", "1") + ["--set=train.max_steps=2", "--set=checkpoint.every=0"]
    with Hosts(2) as hosts:
        addresses = [h.address for h in hosts]
        logs = [tmp_path / f"{h.name}.log" for h in hosts]
        procs = [h.start(argv, log, {**ENV, **variables(rank, addresses)})
                 for rank, (h, log) in enumerate(zip(hosts, logs))]
        wait_all(procs, logs, timeout=180)
    for log in logs:
        assert "Launching 1 process(es) per node x 2 node(s)" in log.read_text(), log.read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["processes"]) == (2, 2), summary
