"""A real SLURM cluster on namespace hosts (hosts.py): slurmctld on host0, a slurmd on every host.

Nothing of this machine's own SLURM or MUNGE set-up is read or written: the MUNGE key, slurm.conf,
SLURM's state and spool folders and the daemons' logs all live in one temporary folder, and every
daemon and client finds them through SLURM_CONF (slurm.conf names the MUNGE socket). One munged, in
host0's namespace, serves every host: its socket is a file, which a process of any network namespace
reaches; on a real cluster each machine runs its own, with the same key.

`Slurm` is a context manager to use inside `Hosts`: leaving it kills every process of the hosts
(daemons, job steps, munged) and removes the folder, whatever happened inside.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from hosts import Host, kill_all

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue")
# How long the daemons get to come up and every node to report in as idle.
START_S = 60


def why_not_here() -> str | None:
    """Why a SLURM cluster cannot be started here (None: it can)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"SLURM and MUNGE are not installed ({', '.join(missing)} missing): run `bash scripts/install-slurm`"
    return None


def slurm_conf(folder: Path, hosts: list[Host]) -> str:
    """A cluster of `hosts`, one CPU each, that keeps everything in `folder` and tracks a job's processes
    by their parent ids (linuxproc): as cgroups do, it signals every process of a step, without needing
    a cgroup file system, which `ip netns exec`'s fresh /sys does not have."""
    nodes = [f"NodeName={h.name} NodeAddr={h.address} CPUs=1 State=UNKNOWN" for h in hosts]
    return "\n".join([
        "ClusterName=gpudl-test",
        f"SlurmctldHost={hosts[0].name}({hosts[0].address})",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        # cred_expire: also how long a requeued job waits before it may start again (+1 s; 120 s by default)
        f"AuthInfo=socket={folder / 'munge' / 'socket'},cred_expire=5",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}/%n",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
        f"PlugStackConfig={folder / 'plugstack.conf'}", "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
        # A pending job is looked at every second, not every minute: a requeued job starts again at once.
        "SchedulerType=sched/builtin", "SchedulerParameters=sched_interval=1",
        # Every host is this machine: the node lines say what they have, not its real CPU count.
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides",
        # A node that went down comes back by itself; a finished job stays in `scontrol show job` (there is
        # no accounting database for sacct) for 10 minutes.
        "ReturnToService=2", "MinJobAge=600",
        "SlurmctldTimeout=30", "SlurmdTimeout=30", "MessageTimeout=10", "InactiveLimit=0", "KillWait=30",
        *nodes,
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n"


class Slurm:
    """slurmctld on hosts[0] and a slurmd on each host, authenticated by one munged; `run` is a SLURM
    client command (sbatch, squeue, scontrol, ...) as a user logged in to hosts[0] runs it."""

    def __init__(self, hosts: list[Host]):
        self.hosts = hosts
        self.folder = Path()
        self.env: dict[str, str] = {}

    def __enter__(self) -> Slurm:
        self.folder = Path(tempfile.mkdtemp(prefix="gpudl-slurm-"))
        self.env = {"SLURM_CONF": str(self.folder / "slurm.conf")}
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def run(self, argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
            check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """`argv` on hosts[0], in this process's environment and `env` (sbatch hands it to the job)."""
        done = subprocess.run(self.hosts[0].command(argv), env={**os.environ, **(env or {}), **self.env}, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr or done.stdout}{self.logs()}")
        return done

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as `scontrol show job` gives them (JobState, ExitCode, Restarts, ...)."""
        line = self.run(["scontrol", "show", "job", "--oneliner", job_id]).stdout
        return dict(word.split("=", 1) for word in line.split() if "=" in word)

    def logs(self, tail: int = 2000) -> str:
        """The end of every daemon's log, for a failure's message."""
        return "".join(f"\n--- {log.name}:\n{log.read_text(errors='replace')[-tail:]}"
                       for log in sorted((self.folder / "logs").glob("*.log")))

    def _start(self) -> None:
        self.folder.chmod(0o755)  # munged wants its socket reachable by every user
        for sub in ["munge", "state", "logs", *(f"spool/{h.name}" for h in self.hosts)]:
            (self.folder / sub).mkdir(parents=True)
        (self.folder / "slurm.conf").write_text(slurm_conf(self.folder, self.hosts))
        (self.folder / "plugstack.conf").touch()  # else /etc/slurm/plugstack.conf
        # slurmd loads a cgroup plugin whatever the tracking; v1's asks nothing of the machine when unused
        (self.folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self._start_munged()
        self._daemon(self.hosts[0], "slurmctld", ["slurmctld", "-D", "-i"])
        for host in self.hosts:
            self._daemon(host, f"slurmd-{host.name}", ["slurmd", "-D", "-N", host.name])
        self._wait(self._all_idle, "every node idle in sinfo")

    def _start_munged(self) -> None:
        """MUNGE wants its key readable by its own user alone; --force lets it run as root, as here."""
        munge = self.folder / "munge"
        key = munge / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._daemon(self.hosts[0], "munged", [
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge / 'socket'}",
            f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}"])  # its log: stderr, in the foreground
        self._wait(lambda: (munge / "socket").exists(), "munged's socket")

    def _daemon(self, host: Host, name: str, argv: list[str]) -> None:
        host.start(argv, self.folder / "logs" / f"{name}.log", self.env)

    def _all_idle(self) -> bool:
        done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False)
        idle = {line.split()[0] for line in done.stdout.splitlines() if line.split()[1:] == ["idle"]}
        return done.returncode == 0 and idle >= {h.name for h in self.hosts}

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_S
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {START_S} s:{self.logs()}")
            time.sleep(0.5)

    def _stop(self) -> None:
        """Every process of the hosts, not only the daemons: a job's steps are slurmstepd's children."""
        kill_all(self.hosts)
        shutil.rmtree(self.folder, ignore_errors=True)
