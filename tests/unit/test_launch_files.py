"""`gpudl launch --emit KIND`: the files written for SLURM, JobSet, PyTorchJob and SkyPilot, and each node's
`gpudl train` reading the variables its scheduler sets (`from_scheduler`).

What is checked here: each file's contents (it parses; nodes, processes, restarts, the run's name), that the
command it runs loads the config `gpudl launch` was given, and that this command, in exactly the environment the
scheduler documents, fills in the node count, node rank and rendezvous endpoint. Nothing is submitted: SLURM is
run under a real slurmctld elsewhere (tests/cluster/), Kubernetes and SkyPilot are not run here.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from argparse import Namespace

import pytest
import yaml  # PyYAML: the test extras bring it (transformers and datasets need it); gpudl itself does not

from gpudl import commands
from gpudl.cli import build_parser, main
from gpudl.config import load_config
from gpudl.errors import UserError
from gpudl.run import launch
from gpudl.run.launch import LaunchArgs, asked_for, from_scheduler

SETS = ["run.name=big-run", "train.max_steps=50", "model.n_layer=2"]
JOB = ["--nnodes", "3", "--nproc-per-node", "4", "--max-restarts", "2"]


def gpudl_launch(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpudl", "launch", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def emitted(kind: str, *extra: str) -> str:
    """The file `gpudl launch --emit kind` prints for gpt-tiny on 3 nodes x 4 processes, 2 restarts."""
    done = gpudl_launch("--emit", kind, "--config", "gpt-tiny", *[f"--set={s}" for s in SETS], *JOB, *extra)
    assert done.returncode == 0, done.stderr
    return done.stdout


def shell_command(script: str) -> list[str]:
    """The `gpudl train ...` words of a shell script (continuation lines joined, a trailing & dropped)."""
    line = next(ln for ln in script.replace("\\\n", " ").splitlines() if "gpudl train" in ln)
    words = shlex.split(line)
    words = words[words.index("gpudl"):]
    return words[:-1] if words[-1] == "&" else words


def config_of(argv: list[str]):
    """The config a node loads from its command line, through gpudl's own parser and train_config."""
    assert argv[:2] == ["gpudl", "train"]
    return commands.train_config(build_parser().parse_args(argv[1:]))


def expected_config(*more_sets: str):
    return load_config("gpt-tiny", [*SETS, *more_sets])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def node_launch_args(argv: list[str], environ: dict[str, str]) -> LaunchArgs:
    """What each node's `gpudl train` launches, as launch_training works it out: its flags, then its scheduler."""
    return from_scheduler(asked_for(build_parser().parse_args(argv[1:])), environ)


def test_sbatch_script(tmp_path, monkeypatch):
    script = emitted("slurm")
    (tmp_path / "job.sbatch").write_text(script)
    syntax = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",  # device auto
                 "#SBATCH --signal=B:USR1@90", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)'):
        assert line in script.splitlines()
    assert "run.dir (runs) must be on a shared filesystem" in script
    argv = shell_command(script)
    assert (flag(argv, "--nproc-per-node"), flag(argv, "--max-restarts"), flag(argv, "--resume")) == ("4", "2", "auto")
    assert flag(argv, "--rdzv-endpoint") == "$head_node:29500"
    monkeypatch.chdir(tmp_path)  # run.dir is relative: no run folder of this tree's is read
    assert config_of(argv).to_toml() == expected_config().to_toml()

    # srun on the allocation's second node (SLURM's srun/sbatch "OUTPUT ENVIRONMENT VARIABLES")
    environ = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NNODES": "3", "SLURM_NODEID": "1",
               "SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1(x3)"}
    on_node = [w.replace("$head_node", "gpu07") for w in argv]  # what `scontrol show hostnames` prints first
    assert node_launch_args(on_node, environ) == LaunchArgs(4, nnodes=3, node_rank=1, rdzv_endpoint="gpu07:29500",
                                                            max_restarts=2)


def test_sbatch_script_for_the_cpu_asks_for_no_gpus():
    script = emitted("slurm", "--set=run.device=cpu")
    assert "--gpus-per-node" not in script and "#SBATCH --nodes=3" in script


def k8s_container(pod_template: dict) -> dict:
    (container,) = pod_template["spec"]["containers"]
    return container


def test_jobset():
    doc = yaml.safe_load(emitted("jobset"))
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet", "big-run")
    assert doc["spec"]["failurePolicy"]["maxRestarts"] == 2
    (rjob,) = doc["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert (rjob["replicas"], job["parallelism"], job["completions"], job["completionMode"]) == (1, 3, 3, "Indexed")
    container = k8s_container(job["template"])
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    argv = container["command"]
    assert (flag(argv, "--nproc-per-node"), flag(argv, "--max-restarts"), flag(argv, "--resume")) == ("4", "2", "auto")
    assert config_of(argv).to_toml() == expected_config("run.dir=/runs").to_toml()
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/runs"}

    # the pod of index 2: the file's env, and what Kubernetes adds to an Indexed Job's pods (Kubernetes'
    # "Jobs" page, Completion mode: JOB_COMPLETION_INDEX); JobSet names the pods (JobSet's "Concepts" page)
    environ = {e["name"]: e["value"] for e in container["env"]} | {"JOB_COMPLETION_INDEX": "2",
                                                                   "HOSTNAME": "big-run-nodes-0-2"}
    assert node_launch_args(argv, environ) == LaunchArgs(4, nnodes=3, node_rank=2, max_restarts=2,
                                                         rdzv_endpoint="big-run-nodes-0-0.big-run:29500")


def pytorchjob_environ(doc: dict, role: str, index: int) -> dict[str, str]:
    """The variables Kubeflow's training operator (v1.9: pkg/controller.v1/pytorch/envvar.go, master.go,
    elastic.go) gives the container of pod `index` of `role`, for this PyTorchJob."""
    spec, name = doc["spec"], doc["metadata"]["name"]
    replicas = {r: s["replicas"] for r, s in spec["pytorchReplicaSpecs"].items()}
    ports = k8s_container(spec["pytorchReplicaSpecs"]["Master"]["template"])["ports"]
    port = str(next(p["containerPort"] for p in ports if p["name"] == "pytorchjob-port"))
    rank = str(index + (1 if role == "Worker" else 0))
    environ = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": port, "PET_MASTER_PORT": port, "MASTER_ADDR": f"{name}-master-0",
               "PET_MASTER_ADDR": f"{name}-master-0", "WORLD_SIZE": str(sum(replicas.values()) * int(spec["nprocPerNode"])),
               "RANK": rank, "PET_NODE_RANK": rank, "PET_NPROC_PER_NODE": spec["nprocPerNode"]}
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        return environ | {"PET_NNODES": str(sum(replicas.values()))}
    return environ | {"PET_RDZV_ENDPOINT": f"{elastic['rdzvHost']}:{elastic['rdzvPort']}",
                      "PET_RDZV_BACKEND": elastic["rdzvBackend"], "PET_MAX_RESTARTS": str(elastic["maxRestarts"]),
                      "PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}"}


def test_pytorchjob_with_restarts_forms_its_group_by_c10d():
    doc = yaml.safe_load(emitted("pytorchjob"))
    spec = doc["spec"]
    assert (doc["apiVersion"], doc["kind"], spec["nprocPerNode"]) == ("kubeflow.org/v1", "PyTorchJob", "4")
    master, worker = spec["pytorchReplicaSpecs"]["Master"], spec["pytorchReplicaSpecs"]["Worker"]
    assert (master["replicas"], worker["replicas"]) == (1, 2)
    assert spec["elasticPolicy"]["rdzvBackend"] == "c10d" and spec["elasticPolicy"]["maxRestarts"] == 2
    container = k8s_container(worker["template"])
    assert container["name"] == "pytorch" and container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    argv = container["command"]
    assert argv == k8s_container(master["template"])["command"]
    assert (flag(argv, "--nproc-per-node"), flag(argv, "--max-restarts")) == ("4", "2")
    assert config_of(argv).to_toml() == expected_config("run.dir=/runs").to_toml()
    assert node_launch_args(argv, pytorchjob_environ(doc, "Worker", 1)) == LaunchArgs(
        4, nnodes=3, node_rank=None, rdzv_endpoint="big-run-master-0:29500", max_restarts=2)  # ranks on joining


def test_pytorchjob_without_restarts_has_fixed_ranks():
    doc = yaml.safe_load(emitted("pytorchjob", "--max-restarts", "0", "--set=run.device=cpu"))
    assert "elasticPolicy" not in doc["spec"]
    container = k8s_container(doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    assert "resources" not in container  # the CPU: no GPU asked for
    assert node_launch_args(container["command"], pytorchjob_environ(doc, "Worker", 1)) == LaunchArgs(
        4, nnodes=3, node_rank=2, rdzv_endpoint="big-run-master-0:29500")


def test_skypilot_task():
    doc = yaml.safe_load(emitted("skypilot"))
    assert (doc["name"], doc["num_nodes"], doc["resources"]["accelerators"]) == ("big-run", 3, "H100:4")
    assert doc["file_mounts"]["/runs"]["mode"] == "MOUNT_CACHED"
    argv = shell_command(doc["run"])
    assert (flag(argv, "--nproc-per-node"), flag(argv, "--max-restarts"), flag(argv, "--resume")) == ("4", "2", "auto")
    assert config_of(argv).to_toml() == expected_config("run.dir=/runs").to_toml()

    # on the second node (SkyPilot's "Environment Variables and Secrets" and "Distributed Multi-Node Jobs" pages)
    environ = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7\n",
               "SKYPILOT_NUM_NODES": "3", "SKYPILOT_NUM_GPUS_PER_NODE": "4", "SKYPILOT_TASK_ID": "sky-2024-big-run_1"}
    assert node_launch_args(argv, environ) == LaunchArgs(4, nnodes=3, node_rank=1, rdzv_endpoint="10.0.0.5:29500",
                                                         max_restarts=2)


def test_a_run_without_a_name_gets_one_name_for_every_node(tmp_path):
    out = tmp_path / "task.yaml"
    done = gpudl_launch("--emit", "skypilot", "--nnodes", "2", "--out", str(out))
    assert done.returncode == 0 and f"Wrote {out}" in done.stdout, done.stdout + done.stderr
    doc = yaml.safe_load(out.read_text())
    (name,) = [w for w in shell_command(doc["run"]) if w.startswith("run.name=")]  # made at emit time
    assert name.startswith("run.name=gpt-tiny-") and doc["name"] == name.removeprefix("run.name=")


@pytest.mark.parametrize("args, words", [
    (["--emit", "nonsense"], "--emit 'nonsense': say which file to write"),
    (["--emit", "slurm", "--set", "train.max_stepz=5"], "max_stepz"),
    (["--emit", "jobset", "--nproc-per-node", "0"], "--nproc-per-node and --nnodes must be >= 1"),
    (["--emit", "slurm", "--nnodes", "2:3"], "a launch file asks its scheduler for a fixed number of nodes"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    done = gpudl_launch(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpudl launch: error: ") and words in done.stderr


def test_flags_win_over_the_environment():
    sky = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6", "SKYPILOT_NUM_NODES": "2"}
    assert from_scheduler(LaunchArgs(2, node_rank=0, rdzv_endpoint="me:1"), sky) == \
        LaunchArgs(2, nnodes=2, node_rank=0, rdzv_endpoint="me:1")
    given = LaunchArgs(2, nnodes=4, rdzv_endpoint="me:1")  # --nnodes: the flags describe the job, nothing is read
    assert from_scheduler(given, {"SLURM_JOB_ID": "1", "SLURM_NNODES": "lots"}) == given
    assert from_scheduler(LaunchArgs(2), {"SLURM_JOB_ID": "1", "SLURM_NNODES": "1"}) == LaunchArgs(2)  # standalone


def test_an_elastic_policy_makes_an_elastic_job():
    """Kubeflow's elasticPolicy with minReplicas < maxReplicas: PET_NNODES "2:4", ranks given on joining."""
    environ = {"PET_NNODES": "2:4", "PET_RDZV_ENDPOINT": "job-master-0:29500", "PET_RDZV_BACKEND": "c10d"}
    assert from_scheduler(LaunchArgs(4), environ) == LaunchArgs(4, nnodes=2, max_nnodes=4, node_rank=None,
                                                                rdzv_endpoint="job-master-0:29500")


def test_kubeflow_before_1_7_sets_the_plain_names():
    """training-operator v1.6 (envvar.go): MASTER_ADDR, MASTER_PORT, WORLD_SIZE (its pods) and RANK only."""
    environ = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
               "PYTHONUNBUFFERED": "0"}
    assert from_scheduler(LaunchArgs(4), environ) == LaunchArgs(4, nnodes=3, node_rank=2,
                                                                rdzv_endpoint="job-master-0:23456")


@pytest.mark.parametrize("environ, words", [
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "two"}, "SLURM_NNODES='two' must be a whole number"),
    ({"PET_NNODES": "3:2", "PET_RDZV_ENDPOINT": "job-worker-0:29500"}, "PET_NNODES='3:2' must be a number of nodes"),
    ({"PET_NNODES": "1:4", "PET_MASTER_ADDR": "a"}, "PET_NNODES='1:4' is a range, which needs the c10d rendezvous"),
    ({"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "job-worker-0"}, "PET_RDZV_ENDPOINT='job-worker-0' must be host:port"),
    ({"PET_NNODES": "2"}, "neither PET_RDZV_ENDPOINT nor PET_MASTER_ADDR"),
    ({"PET_NNODES": "2", "PET_MASTER_ADDR": "a", "JOB_COMPLETION_INDEX": "-1"}, "JOB_COMPLETION_INDEX='-1'"),
    ({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": ""}, "SKYPILOT_NODE_IPS holds no address"),
])
def test_a_malformed_variable_is_named_with_the_fix(environ, words):
    with pytest.raises(UserError, match=words) as e:
        from_scheduler(LaunchArgs(4), environ)
    assert "\n" not in str(e.value) and "or give --nnodes, --node-rank and --rdzv-endpoint" in str(e.value)


def test_a_pytorchjob_pods_rank_is_not_a_worker(monkeypatch):
    """The operator sets RANK (the node's) for the launcher: `gpudl train --nproc-per-node` still launches."""
    launched = []
    monkeypatch.setattr(launch, "launch_training", lambda args, cfg, console: launched.append(args) or 0)
    monkeypatch.setitem(os.environ, "RANK", "1")
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "8")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["train", "--nproc-per-node", "4", "--set", "run.device=cpu"]) == 0 and len(launched) == 1


def test_resume_auto_continues_or_starts_the_named_run(tmp_path):
    cfg = load_config("gpt-tiny", [f"run.dir={tmp_path}", "run.name=big-run"])
    (tmp_path / "big-run" / "checkpoints" / "step_5").mkdir(parents=True)  # a requeued job's earlier start
    args = Namespace(resume="auto", config="gpt-tiny", sets=[], device=None, precision=None, plan=None,
                     memory_limit=None, debug=False)
    run_dir = launch._run_folder(args, cfg, LaunchArgs(4, nnodes=2))
    assert run_dir == tmp_path / "big-run"
    assert launch._worker_argv(args, run_dir)[-2:] == ["--resume", "auto"]
