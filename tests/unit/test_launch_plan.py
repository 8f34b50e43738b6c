"""The launcher's decisions, without starting processes."""

import os
import socket

import pytest

from gpudl.cli import main
from gpudl.distributed import env as denv
from gpudl.run.launch import LaunchArgs, from_slurm, node_range, torchrun_argv, wait_for_endpoint, worlds
from gpudl.distributed.mesh import ParallelDims
from gpudl.errors import UserError


def test_torchrun_command_lines():
    single = torchrun_argv(LaunchArgs(4, max_restarts=2), ["train", "--set", "a.b=1"])
    assert single[:5] == ["--nproc-per-node", "4", "--max-restarts", "2", "--standalone"]
    assert single[-5:] == ["-m", "gpudl", "train", "--set", "a.b=1"]
    elastic = torchrun_argv(LaunchArgs(8, nnodes=2, rdzv_endpoint="node0:29500"), ["train"])
    assert "c10d" in elastic and "node0:29500" in elastic and "--standalone" not in elastic
    here = torchrun_argv(LaunchArgs(1, nnodes=2, rdzv_endpoint="127.0.0.1:29500"), ["train"])
    assert here[here.index("--local-addr") + 1] == "127.0.0.1"  # what this node tells the others it is
    # where torch's guess from the hostname is right, it makes it (tests/cluster: where it is wrong)
    assert "is_host" not in elastic[elastic.index("--rdzv-conf") + 1]
    assert "is_host" not in here[here.index("--rdzv-conf") + 1]
    static = torchrun_argv(LaunchArgs(8, nnodes=2, node_rank=1, rdzv_endpoint="node0:1234"), ["train"])
    assert static[static.index("--node-rank") + 1] == "1" and static[static.index("--master-port") + 1] == "1234"


def test_an_elastic_node_range():
    assert node_range("2") == (2, 2) and node_range("2:3") == (2, 3)
    for bad in ("0", "3:2", "two", "2:", ":3", "1:x"):
        with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
            node_range(bad)
    job = LaunchArgs(2, nnodes=2, max_nnodes=3, rdzv_endpoint="node0:29500", join_timeout_s=10)
    argv = torchrun_argv(job, ["train"])
    assert argv[argv.index("--nnodes") + 1] == "2:3"
    # a dead node is dropped after 3 missed heartbeats of 1 s, and once 2 nodes are there the
    # rendezvous waits for a third 3 s: the survivors meet again within the join timeout
    assert argv[argv.index("--rdzv-conf") + 1].startswith(
        "join_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3")
    assert worlds(job) == [4, 6] and job.several and LaunchArgs(2, nnodes=1, max_nnodes=2).several
    fixed = torchrun_argv(LaunchArgs(2, nnodes=2, rdzv_endpoint="node0:29500"), ["train"])
    assert fixed[fixed.index("--nnodes") + 1] == "2" and "last_call" not in fixed[fixed.index("--rdzv-conf") + 1]


@pytest.mark.parametrize("argv, says", [
    (["--nnodes", "3:2"], "--nnodes '3:2': give a node count (2) or an elastic range MIN:MAX"),
    (["--nnodes", "2:3", "--node-rank", "0", "--rdzv-endpoint", "x:1"], "(elastic) gives nodes their ranks as they join"),
    # every size the job may shrink to must fit the layout: 3 nodes x 1 process cannot hold tp=2
    (["--nnodes", "2:3", "--rdzv-endpoint", "x:1", "--set", "parallel.tp=2"], "divisible by 2, got 3"),
])
def test_a_bad_elastic_job_is_one_line_before_anything_starts(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["train", "--device", "cpu", "--nproc-per-node", "1", "--set", "run.name=r", *argv])
    except SystemExit as e:  # argparse's own refusal of the value
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert not (tmp_path / "runs").exists()


def test_slurm_fills_nodes_rank_and_endpoint():
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[03-06]"}
    la = from_slurm(LaunchArgs(8), env)
    assert (la.nnodes, la.node_rank, la.rdzv_endpoint, la.world) == (4, 2, "gpu03:29500", 32)
    assert from_slurm(LaunchArgs(8), {}) == LaunchArgs(8)


def test_environment_of_a_worker():
    assert denv.read_env({}) is None
    tr = denv.read_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                        "TORCHELASTIC_RESTART_COUNT": "1"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.restart_count) == (3, 8, 1, 1)
    sl = denv.read_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                        "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert (sl.rank, sl.world_size, sl.local_rank, sl.local_world_size) == (5, 8, 1, 4)
    assert denv.slurm_rendezvous({"SLURM_JOB_NODELIST": "a1,b2", "SLURM_JOB_ID": "5"}) == ("a1", 20005)
    assert denv._first_slurm_host("node[12-15,20]") == "node12"


def test_more_processes_than_devices_is_refused(monkeypatch):
    monkeypatch.setattr(denv.torch.accelerator, "device_count", lambda: 2)
    env = denv.DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4)
    with pytest.raises(UserError, match="4 processes per node but only 2 cuda device"):
        denv.check_devices(env, "cuda")
    denv.check_devices(env, "cpu")  # processes share the CPU: any number is allowed


@pytest.mark.parametrize("degrees, world, words", [
    (dict(dp_replicate="auto", dp_shard="auto", tp=4, pp=1), 6, "divisible by 4, got 6"),
    (dict(dp_replicate=2, dp_shard=2, tp=1, pp=1), 8, "multiply to 4, but there are 8 processes"),
])
def test_degrees_that_do_not_fit_the_world_name_every_factor(degrees, world, words):
    with pytest.raises(UserError, match=words) as e:
        ParallelDims.resolve(world=world, **degrees)
    assert all(f"{k}=" in str(e.value) for k in degrees)


@pytest.mark.parametrize("degrees, world, expect", [
    (dict(dp_replicate="auto", dp_shard="auto", tp=2, pp=1), 8, (4, 1, 2, 1)),
    (dict(dp_replicate="auto", dp_shard=2, tp=1, pp=2), 8, (2, 2, 1, 2)),
])
def test_auto_degrees_take_the_rest(degrees, world, expect):
    d = ParallelDims.resolve(world=world, **degrees)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.pp) == expect and d.world == world
    shard = ParallelDims.resolve(world=4, dp_replicate="auto", dp_shard="auto", tp=1, pp=1, shard=True)
    assert (shard.dp_replicate, shard.dp_shard) == (1, 4)


def test_the_launcher_checks_before_starting_anything(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--nproc-per-node", "3", "--set", "parallel.tp=2"]) == 2
    err = capsys.readouterr().err
    assert "need a number of processes divisible by 2, got 3" in err and len(err.strip().splitlines()) == 1
    # On the CPU: a machine with one GPU would refuse two processes per node first.
    assert main(["train", "--device", "cpu", "--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "x:1"]) == 2
    assert "needs one run name on all of them" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_an_unreachable_endpoint_is_a_clear_error_not_a_hang(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    # 127.0.0.2 is this machine's (loopback): taken here for another one, which waits for it to answer.
    # (tests/cluster has the real thing: hosts with addresses of their own)
    monkeypatch.setattr("gpudl.run.launch.is_local", lambda host: False)
    with pytest.raises(UserError, match=f"cannot reach the rendezvous endpoint 127.0.0.2:{port} after 2 s"):
        wait_for_endpoint(f"127.0.0.2:{port}", wait_s=2)


def test_a_launcher_whose_workers_are_gone_for_too_long_ends_with_one_line():
    """The watch for an agent stuck reading an unreachable store (tests/cluster: a host whose link went
    down): it counts running children only, and ends its process once they have been gone `limit_s`."""
    import subprocess
    import sys

    child = subprocess.Popen(["sleep", "30"])
    try:
        from gpudl.run.stuck import running_children
        assert child.pid in running_children(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert child.pid not in running_children(os.getpid())
    script = ("import subprocess, time\nfrom gpudl.run.stuck import StuckAgentWatch\n"
              "StuckAgentWatch(1.0, 'node0:29500', poll_s=0.1).start()\n"
              "subprocess.run(['sleep', '0.5'])\ntime.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=25)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "this node's workers stopped 1 s ago" in done.stderr and "store on node0 to finish" in done.stderr
