"""A launcher whose workers have stopped but whose agent cannot finish, stopped with one line.

torchrun's agent keeps reading the rendezvous store on the endpoint's host, between its checks of
the workers and in its keep-alive. On a host cut off from the network such a read waits as long as
TCP retries (a quarter of an hour on Linux): the workers have said what went wrong and exited, and
the agent sits in the read. This watch, a thread in the launcher, sees that no worker has run for
longer than a rendezvous may take, says so and ends the process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

# What the agent may take beyond the join timeout to notice its workers' exit and stop by itself: it
# looks at them every 0.1 s (torchrun's --monitor-interval), and between restarts meets the others
# again within the join timeout.
SLACK_S = 10.0


def running_children(pid: int) -> list[int]:
    """The processes `pid` started that are still running (not exited and waiting to be reaped). From
    every process's stat: /proc/PID/task/TID/children is missing where a kernel is built without it."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(entry)
            if stat is not None and stat[1] == pid and stat[0] not in "ZX":
                found.append(int(entry.name))
    return found


def _stat(proc: Path) -> tuple[str, int] | None:
    """A process's state letter and its parent's pid, or None if it has gone."""
    try:
        stat = (proc / "stat").read_text()
    except OSError:
        return None
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]  # after "pid (comm) "
    return state, int(ppid)


class StuckAgentWatch(threading.Thread):
    """Ends this process once it has had workers and has had none for `limit_s` (the join timeout and
    SLACK_S: longer than any rendezvous between restarts)."""

    def __init__(self, limit_s: float, endpoint: str | None, poll_s: float = 1.0):
        super().__init__(daemon=True, name="gpudl-stuck-agent")
        self.limit_s, self.endpoint, self.poll_s = limit_s, endpoint, poll_s

    def run(self) -> None:
        if not Path("/proc/self/stat").is_file():  # not Linux: nothing to watch with
            return
        had_workers, last_seen = False, time.monotonic()
        while True:
            if running_children(os.getpid()):
                had_workers, last_seen = True, time.monotonic()
            elif had_workers and time.monotonic() - last_seen > self.limit_s:
                self.stop(time.monotonic() - last_seen)
            time.sleep(self.poll_s)

    def stop(self, idle_s: float) -> None:
        where = f"on {self.endpoint.rpartition(':')[0]}" if self.endpoint else "on the endpoint's host"
        sys.stderr.write(f"gpudl train: error: this node's workers stopped {idle_s:.0f} s ago (their own lines are "
                         f"above) and its launcher cannot reach the job's rendezvous store {where} to finish: this "
                         f"host is cut off from the others' network, or that host is down\n")
        sys.stderr.flush()
        os._exit(1)
