"""`gpudl train --nnodes 2` on two hosts (network namespaces, each its own address and hostname)
trains as one host with two processes does."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hosts import Host, Hosts, why_not_here
from runs import ENV, PORT, gpudl, losses, newest_checkpoint, records, train_alone, train_argv, wait_all

pytestmark = pytest.mark.skipif(why_not_here() is not None, reason=why_not_here() or "")

_references: dict[tuple, Path] = {}


def one_host(tmp_path_factory, processes: int, sets: tuple[str, ...]) -> Path:
    """The reference: the same run on this machine alone with as many processes (once per layout)."""
    if (processes, sets) not in _references:
        _references[processes, sets] = train_alone(tmp_path_factory.mktemp("one") / "run", processes, sets)
    return _references[processes, sets]


# layout: (its settings, processes per host, the endpoint given by name or by address)
# (DDP by name: the slow link's test, below)
LAYOUTS = {"fsdp": (("parallel.dp_shard=2",), 1, "address"),
           # tensor parallel inside each host, FSDP across the two
           "tp-in-hosts-fsdp-across": (("parallel.tp=2", "parallel.dp_shard=2"), 2, "name")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_hosts_train_as_one_host_with_as_many_processes(layout, tmp_path, tmp_path_factory):
    """By name, where each host's name resolves to its address; by address, where the hosts share one
    hostname that resolves to neither (containers on one machine, or a name on another network): a host
    knows the endpoint is its own from its addresses, not its name."""
    sets, per_host, endpoint = LAYOUTS[layout]
    run_dir = tmp_path / "two" / "run"
    with Hosts(2, resolve=endpoint == "name") as hosts:
        where = f"host0:{PORT}" if endpoint == "name" else f"{hosts[0].address}:{PORT}"
        launch = ["--nnodes", "2", "--nproc-per-node", str(per_host), "--rdzv-endpoint", where]
        logs = [tmp_path / f"{h.name}.log" for h in hosts]
        argv = train_argv(run_dir, *launch) + [f"--set={s}" for s in sets]
        procs = [h.start(argv, log, ENV, hostname="node" if endpoint == "address" else None)
                 for h, log in zip(hosts, logs)]
        wait_all(procs, logs, timeout=240)
    assert_same_run(run_dir, one_host(tmp_path_factory, 2 * per_host, sets))


def assert_same_run(run_dir: Path, want: Path) -> None:
    """Every step's loss and every final weight within 1e-6 of the reference run's."""
    got_losses, want_losses = losses(run_dir), losses(want)
    assert got_losses.keys() == want_losses.keys() == set(range(1, 11))
    for step, loss in want_losses.items():
        assert abs(got_losses[step] - loss) <= 1e-6, f"loss at step {step}: {got_losses[step]} vs {loss}"
    got_w, want_w = load_file(str(run_dir / "model.safetensors")), load_file(str(want / "model.safetensors"))
    assert got_w.keys() == want_w.keys()
    for name, t in want_w.items():
        assert torch.allclose(got_w[name], t, atol=1e-6, rtol=0), name


def kill_after_first_checkpoint(host0: Host, host1: Host, argv: list[str], logs: list[Path], run_dir: Path,
                                stop_within_s: float) -> tuple[int, float]:
    """Start `argv` on both hosts; once the run has a checkpoint, kill host1 (every process at once):
    host0's exit code and the seconds it took to stop, which must be fewer than `stop_within_s`."""
    procs = [h.start(argv, log, ENV) for h, log in zip((host0, host1), logs)]
    deadline = time.monotonic() + 180
    while newest_checkpoint(run_dir) == 0 and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.2)
    assert newest_checkpoint(run_dir) > 0, logs[0].read_text()[-3000:]
    killed = time.monotonic()
    host1.kill()
    code = procs[0].wait(timeout=stop_within_s)
    return code, time.monotonic() - killed


def test_a_host_that_does_not_share_the_run_folder_is_refused_at_start(tmp_path):
    """host1 mounts a folder of its own at run.dir (its mount namespace): both hosts stop before the
    first step, saying that the folder must be shared and which rank does not see it."""
    run_root, private = tmp_path / "runs", tmp_path / "private"
    run_root.mkdir()
    private.mkdir()
    run_dir = run_root / "run"
    own_mount = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                 'mount --bind "$0" "$1" && shift && exec "$@"', str(private), str(run_root)]
    with Hosts(2) as (host0, host1):
        launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"host0:{PORT}"]
        logs = [tmp_path / "host0.log", tmp_path / "host1.log"]
        procs = [host0.start(train_argv(run_dir, *launch), logs[0], ENV),
                 host1.start(own_mount + train_argv(run_dir, *launch), logs[1], ENV)]
        codes = [p.wait(timeout=120) for p in procs]
    outs = [" ".join(log.read_text().split()) for log in logs]
    for code, out in zip(codes, outs):
        assert code == 2 and f"run.dir is not shared: rank(s) 1 do not see {run_dir} as rank 0 wrote it" in out, out[-3000:]
    assert "(this is rank 1, on host1)" in outs[1]
    assert not (run_dir / "checkpoints").exists() and "step 1 " not in outs[0]


def test_a_killed_host_with_no_spare_is_named_and_the_run_resumes_on_another(tmp_path):
    """host1 loses power (every process of it killed at once) after the first checkpoint, with
    --max-restarts 1 and no host to take its place: host0's worker names rank 1 on host1; its agent
    restarts it and waits at the rendezvous for parallel.timeout_s (10 s), then stops with one line that
    says so and gives the resume command. The checkpoint is intact: host0 and a new host2 finish the run."""
    run_dir = tmp_path / "run"
    with Hosts(3) as (host0, host1, host2):
        launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"host0:{PORT}"]
        logs = [tmp_path / "host0.log", tmp_path / "host1.log"]
        argv = train_argv(run_dir, *launch, "--max-restarts", "1") + \
            ["--set=train.max_steps=400", "--set=parallel.timeout_s=10"]
        code, stopped_s = kill_after_first_checkpoint(host0, host1, argv, logs, run_dir, stop_within_s=10 + 30)
        print(f"host0 stopped {stopped_s:.1f} s after host1 was killed")
        out, saved = " ".join(logs[0].read_text().split()), newest_checkpoint(run_dir)
        assert code == 2 and "rank 1 on host1 (10.231.0.11) is gone" in out, out[-3000:]
        assert "the job's 2 nodes were not all there within 10 s (parallel.timeout_s): a node did not start, or " \
               f"one stopped and none took its place; the newest checkpoint is step {saved}. Resume with: gpudl " \
               f"train --nproc-per-node 1 --nnodes 2 --rdzv-endpoint host0:{PORT} --resume {run_dir} (on every " \
               "node)" in out and "Traceback" not in out, out[-3000:]
        again = gpudl("train", *launch, "--resume", str(run_dir), "--set=train.max_steps=" + str(saved + 5))
        logs = [tmp_path / "host0-again.log", tmp_path / "host2.log"]
        wait_all([h.start(again, log, ENV) for h, log in zip((host0, host2), logs)], logs, timeout=240)
    assert f"Resuming at step {saved}" in " ".join(logs[0].read_text().split())
    assert max(losses(run_dir)) == saved + 5


def median_step_s(run_dir: Path) -> float:
    times = sorted(r["step_s"] for r in records(run_dir) if r["kind"] == "train" and r["step"] > 1)
    return times[len(times) // 2]


def test_a_slow_lossy_link_slows_the_job_and_changes_nothing_else(tmp_path, tmp_path_factory):
    """DDP over two hosts, the endpoint by name, and host1 sending at 8 Mbit/s through a 16 kB queue that
    drops what overflows (the gradients are 136 kB a step): the job is slower, by a factor it prints, and
    its losses and weights are within 1e-6 of one host's with two processes."""
    run_dir = tmp_path / "run"
    with Hosts(2) as (host0, host1):
        host1.slow_link("8mbit", "16kb")
        launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"host0:{PORT}"]
        logs = [tmp_path / "host0.log", tmp_path / "host1.log"]
        wait_all([h.start(train_argv(run_dir, *launch), log, ENV) for h, log in zip((host0, host1), logs)],
                 logs, timeout=240)
        dropped = host1.dropped()
    want = one_host(tmp_path_factory, 2, ())
    assert_same_run(run_dir, want)
    slow, fast = median_step_s(run_dir), median_step_s(want)
    assert dropped > 0 and slow > fast
    print(f"a step over the slow link: {slow * 1e3:.0f} ms against {fast * 1e3:.0f} ms on one host "
          f"({slow / fast:.1f}x); {dropped} packets dropped and resent")


def test_a_host_cut_off_from_the_network_is_named_by_the_others_within_the_timeout(tmp_path):
    """host1's link goes down after the first checkpoint (its processes live on, unreachable): host0's
    collective times out after parallel.timeout_s and names rank 1 as the one that never arrived. host1's
    worker times out too and finds the job's store silent; its launcher, whose own reads of that store
    would wait as long as TCP retries, stops once its workers have been gone longer than a rendezvous
    may take (the join timeout and 10 s). Neither hangs."""
    run_dir = tmp_path / "run"
    with Hosts(2) as (host0, host1):
        launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"host0:{PORT}"]
        logs = [tmp_path / "host0.log", tmp_path / "host1.log"]
        argv = train_argv(run_dir, *launch) + ["--set=train.max_steps=400", "--set=parallel.timeout_s=5"]
        procs = [h.start(argv, log, ENV) for h, log in zip((host0, host1), logs)]
        deadline = time.monotonic() + 180
        while newest_checkpoint(run_dir) == 0 and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.1)
        cut = time.monotonic()
        host1.link(False)
        # host0: the timeout and 30 s; host1: the timeout, 10 s for the store, the join timeout and 10 s
        codes, stopped = [], []
        for proc, bound in zip(procs, (5 + 30, 5 + 10 + 5 + 10 + 30)):
            try:
                codes.append(proc.wait(timeout=max(1.0, cut + bound - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
            stopped.append(time.monotonic() - cut)
    outs = [" ".join(log.read_text().split()) for log in logs]
    assert codes[0] not in (0, None) and "timed out after 5 s on rank 0: rank 1 never arrived" in outs[0], outs[0][-3000:]
    assert codes[1] is not None, f"host1 still running {stopped[1]:.0f} s after its link went down: {outs[1][-3000:]}"
    assert codes[1] != 0 and "timed out after 5 s on rank 1: the job's store (on rank 0's host) did not answer " \
                             "within 10 s either: this host is cut off from the others' network" in outs[1], outs[1][-3000:]
    assert "its launcher cannot reach the job's rendezvous store on host0 to finish" in outs[1], outs[1][-3000:]
    print(f"host1's link down: host0 stopped after {stopped[0]:.1f} s, host1 after {stopped[1]:.1f} s")
