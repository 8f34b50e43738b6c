"""The sbatch script that `gpudl launch --emit slurm` writes, submitted to a real SLURM cluster of two
namespace hosts (slurm.py): srun starts one `gpudl train` per node, and they train as one job of two
processes; requeued mid-run (what pre-emption does), the job resumes from a checkpoint and ends
where an uninterrupted one does, bit for bit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hosts
import slurm

pytestmark = [pytest.mark.skipif(hosts.why_not_here() is not None, reason=hosts.why_not_here() or ""),
              pytest.mark.skipif(slurm.why_not_here() is not None, reason=slurm.why_not_here() or "")]

# gpt-tiny, narrowed as in test_two_hosts.py: about 10 ms a step, so that the run goes on for a few
# seconds after its first checkpoint, long enough to requeue it in between
STEPS, EVERY = 240, 40
RUN = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.block_size=32", "train.batch_size=4",
       f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=0", "train.precision=fp32",
       "train.compile=false", "train.time_budget_s=0", "sample.tokens=0", "log.progress=false", "log.plot=false",
       f"checkpoint.every={EVERY}", "run.device=cpu"]
# One thread per process, so that every run sums in the same order; the script's `gpudl` is this one.
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
JOB_S = 240
# What interrupt.py does with the second SIGTERM that every worker gets under SLURM (see the test's docstring)
@dataclass
class Job:
    id: str
    run_dir: Path
    output: Path  # the job's log: the batch script's and every node's gpudl output, each start appended


@pytest.fixture(scope="module")
def cluster():
    with hosts.Hosts(2) as machines, slurm.Slurm(machines) as running:
        yield running


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    """`gpudl launch --emit slurm`'s script for 2 nodes of one process each. Its run.dir is relative: each
    job's is in the folder it was submitted from, as the script's header says."""
    sets = [f"--set={s}" for s in [*RUN, "run.dir=runs", "run.name=job"]]
    done = subprocess.run([sys.executable, "-m", "gpudl", "launch", "--emit", "slurm", "--nnodes", "2",
                           "--nproc-per-node", "1", *sets], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    path = tmp_path_factory.mktemp("slurm") / "job.sbatch"
    path.write_text(done.stdout)
    return path


@pytest.fixture(scope="module")
def finished(cluster, script, tmp_path_factory) -> Job:
    """One job run from start to end, undisturbed."""
    job = submit(cluster, script, tmp_path_factory.mktemp("undisturbed"))
    fields = wait_ended(cluster, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"{fields}\n{tail(job)}"
    return job


def submit(cluster: slurm.Slurm, script: Path, folder: Path) -> Job:
    """`script`, submitted from `folder`: its output and its run folder (runs/job) land there."""
    job_id = cluster.run(["sbatch", "--parsable", str(script)], cwd=folder, env=ENV).stdout.strip().split(";")[0]
    return Job(job_id, folder / "runs" / "job", folder / f"job-{job_id}.out")


def wait_ended(cluster: slurm.Slurm, job: Job) -> dict[str, str]:
    """The job's fields once it has ended; a requeued job is PENDING again in between, and waited for."""
    deadline = time.monotonic() + JOB_S
    while (fields := cluster.job(job.id))["JobState"] not in ENDED:
        if time.monotonic() > deadline:
            pytest.fail(f"job {job.id} still {fields['JobState']} after {JOB_S} s:\n{tail(job)}{cluster.logs()}")
        time.sleep(0.5)
    return fields


def wait_checkpoint(cluster: slurm.Slurm, job: Job) -> None:
    """Until the job's first checkpoint is complete (its manifest is written last)."""
    deadline = time.monotonic() + JOB_S
    while not any((job.run_dir / "checkpoints").glob("step_*/manifest.json")):
        if time.monotonic() > deadline or cluster.job(job.id)["JobState"] in ENDED:
            pytest.fail(f"job {job.id} saved no checkpoint:\n{tail(job)}{cluster.logs()}")
        time.sleep(0.05)


def tail(job: Job) -> str:
    return job.output.read_text(errors="replace")[-4000:] if job.output.exists() else "(no job output)"


def steps_said(job: Job, pattern: str) -> list[int]:
    """The step numbers the job's output gives in the lines `pattern` matches (its group: the number)."""
    return [int(n) for n in re.findall(pattern, job.output.read_text())]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_sbatch_trains_on_two_nodes_as_one_job(cluster, finished):
    summary = json.loads((finished.run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["processes"]) == (STEPS, 2), summary
    assert set(losses(finished.run_dir)) == set(range(1, STEPS + 1))
    assert cluster.run(["squeue", "--noheader"]).stdout.strip() == ""
    # each node's launcher took the node count from srun's variables
    launched = [line for line in finished.output.read_text().splitlines() if line.startswith("Launching")]
    assert len(launched) == 2 and all("x 2 node(s)" in line for line in launched), tail(finished)


def test_requeued_job_resumes_from_a_checkpoint(cluster, script, finished, tmp_path):
    """`scontrol requeue` after the first checkpoint: SLURM sends SIGTERM to every process of the job's
    steps, and the job starts again from the top of its script, whose `--resume auto` continues the run.

    Each worker gets SIGTERM twice: from slurmstepd (which signals all of a step's processes) and, a few ms
    later, from torchrun's agent, which got it too and passes it on. The second is ignored (run/interrupt.py):
    taken for "stop at once", it lost the checkpoint of the stop in about 3 runs of 10, and the job resumed
    from the periodic one instead."""
    job = submit(cluster, script, tmp_path)
    wait_checkpoint(cluster, job)
    cluster.run(["scontrol", "requeue", job.id])
    fields = wait_ended(cluster, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        f"{fields}\n{tail(job)}"
    resumed = steps_said(job, r"Resuming at step (\d+)")
    assert len(resumed) == 1 and EVERY <= resumed[0] < STEPS, f"not resumed mid-run: {resumed}\n{tail(job)}"
    got, want = losses(job.run_dir), losses(finished.run_dir)
    assert got.keys() == want.keys() == set(range(1, STEPS + 1))
    assert [s for s in want if got[s] != want[s]] == [], "losses differ from the undisturbed job's"
    got_w, want_w = (load_file(str(j.run_dir / "model.safetensors")) for j in (job, finished))
    assert got_w.keys() == want_w.keys() and all(torch.equal(got_w[k], want_w[k]) for k in want_w)
    assert steps_said(job, r"Stopped at step (\d+) of") == resumed, f"not resumed from the stop's checkpoint\n{tail(job)}"


def wait_for(cluster: slurm.Slurm, job: Job, done, what: str) -> None:
    deadline = time.monotonic() + JOB_S
    while not done():
        if time.monotonic() > deadline or cluster.job(job.id)["JobState"] in ENDED:
            pytest.fail(f"job {job.id}: no {what}:\n{tail(job)}{cluster.logs()}")
        time.sleep(0.05)


def test_the_warning_signal_requeues_and_scancel_keeps_the_newest_checkpoint(cluster, script, finished, tmp_path):
    """USR1 to the batch shell, as `#SBATCH --signal=B:USR1@90` sends it 90 s before the time limit (here
    at once, by `scancel --signal=USR1 --batch`: slurmctld sends the timed one up to 30 s late), runs the
    script's trap: every node's gpudl saves and stops, and the job requeues itself. Its second start is
    cancelled mid-run (`scancel`: SIGTERM to every step, SIGKILL after KillWait): gpudl saves again and
    the newest checkpoint is whole, so the script submitted anew ends where the undisturbed job does."""
    job = submit(cluster, script, tmp_path)
    wait_checkpoint(cluster, job)
    cluster.run(["scancel", "--signal=USR1", "--batch", job.id])
    wait_for(cluster, job, lambda: cluster.job(job.id)["Restarts"] == "1", "requeue after USR1")
    wait_for(cluster, job, lambda: len(steps_said(job, r"step +(\d+) ·")) > len(steps_said(job, r"Resuming at step (\d+)"))
             and steps_said(job, r"Resuming at step (\d+)"), "step after the requeue")
    cluster.run(["scancel", job.id])
    fields = wait_ended(cluster, job)
    assert fields["JobState"] == "CANCELLED", f"{fields}\n{tail(job)}"
    stops, resumed = steps_said(job, r"Stopped at step (\d+) of"), steps_said(job, r"Resuming at step (\d+)")
    assert len(stops) == 2 and resumed == stops[:1], f"a stop per signal, the second start from the first\n{tail(job)}"
    again = submit(cluster, script, tmp_path)  # the same folder: --resume auto continues runs/job
    fields = wait_ended(cluster, again)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"{fields}\n{tail(again)}"
    assert steps_said(again, r"Resuming at step (\d+)") == stops[1:], tail(again)
    got, want = losses(job.run_dir), losses(finished.run_dir)
    assert got.keys() == want.keys() and [s for s in want if got[s] != want[s]] == []
    got_w, want_w = (load_file(str(j.run_dir / "model.safetensors")) for j in (job, finished))
    assert all(torch.equal(got_w[k], want_w[k]) for k in want_w)
