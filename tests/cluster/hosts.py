"""Hosts made of Linux namespaces, for tests of jobs over several machines.

Each host is a network namespace with its own address on a bridge, and every command it runs gets a
UTS namespace with the host's own hostname. The bridge lives in a namespace of its own too (the
"switch"), so no interface, address or route of the machine running the tests is touched, and
nothing the hosts send leaves the namespaces made here. `ip netns exec` shows a host
/etc/netns/<namespace>/hosts as its /etc/hosts: that is how host names resolve, when a test wants them to.

`Hosts` is a context manager: leaving it kills every process in the namespaces and removes them,
whatever happened inside.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.0"


def why_not_here() -> str | None:
    """Why namespace hosts cannot be made on this machine (None: they can)."""
    if sys.platform != "linux":
        return "namespace hosts need Linux"
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns, unshare)"
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"namespace hosts need {' and '.join(missing)} (iproute2, util-linux)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str        # its hostname
    namespace: str   # its network namespace
    address: str     # its address on the bridge

    def command(self, argv: list[str], hostname: str | None = None) -> list[str]:
        """`argv` as this host runs it: in its network namespace, under its hostname (or `hostname`)."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', hostname or self.name, *argv]

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None,
              hostname: str | None = None) -> subprocess.Popen:
        """Start `argv` on this host, its output (both streams) in `log`."""
        with open(log, "ab") as out:
            return subprocess.Popen(self.command(argv, hostname), stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, start_new_session=True)

    def pids(self) -> list[int]:
        return _pids(self.namespace)

    def kill(self) -> None:
        """Every process of this host dies at once, as when the machine loses power."""
        _kill_namespace(self.namespace)

    def link(self, up: bool) -> None:
        """Plug this host's cable in or pull it out."""
        _ip("-n", self.namespace, "link", "set", "eth0", "up" if up else "down")

    def slow_link(self, rate: str, queue: str) -> None:
        """What this host sends goes out at `rate` ("8mbit"), through a queue of `queue` bytes ("16kb"): a
        packet that finds it full is dropped, and TCP resends it. A token bucket (tbf): the kernel this
        tier was written on has no netem, so loss comes from a queue that overflows, not a dice roll."""
        subprocess.run(["ip", "netns", "exec", self.namespace, "tc", "qdisc", "replace", "dev", "eth0", "root",
                        "tbf", "rate", rate, "burst", "4kb", "limit", queue], check=True, capture_output=True)

    def dropped(self) -> int:
        """Packets the slow link's queue has dropped so far."""
        shown = subprocess.run(["ip", "netns", "exec", self.namespace, "tc", "-s", "qdisc", "show", "dev", "eth0"],
                               check=True, capture_output=True, text=True).stdout
        return int(re.search(r"dropped (\d+)", shown).group(1))


class Hosts:
    """`n` hosts named host0, host1, ... on one bridge; `resolve`: whether their names resolve (through
    each host's /etc/hosts) to their addresses."""

    def __init__(self, n: int, resolve: bool = True):
        self.tag = f"gdt{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [Host(f"host{i}", f"{self.tag}-h{i}", f"{SUBNET}.{10 + i}") for i in range(n)]
        self.resolve = resolve

    def __enter__(self) -> list[Host]:
        _remove_orphans()
        try:
            self._make()
        except BaseException:
            self._remove()
            raise
        return self.hosts

    def __exit__(self, *exc) -> None:
        self._remove()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host.namespace)
            _ip("link", "add", f"v{i}", "netns", self.switch, "type", "veth", "peer", "name", "eth0",
                "netns", host.namespace)
            _ip("-n", self.switch, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"v{i}", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            self._hosts_file(host)

    def _hosts_file(self, host: Host) -> None:
        folder = Path("/etc/netns") / host.namespace
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"]
        if self.resolve:
            lines += [f"{h.address} {h.name}" for h in self.hosts]
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def _remove(self) -> None:
        kill_all(self.hosts)
        for namespace in [h.namespace for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def kill_all(hosts: list[Host], wait_s: float = 10) -> None:
    """Every process of `hosts` killed, and gone (up to `wait_s`) before the caller removes what they used."""
    for host in hosts:
        host.kill()
    deadline = time.monotonic() + wait_s
    while any(h.pids() for h in hosts) and time.monotonic() < deadline:
        time.sleep(0.1)


def _pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def _kill_namespace(namespace: str) -> None:
    for pid in _pids(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove_orphans() -> None:
    """Namespaces left by a test process that was killed before it could remove them (SIGKILL, or a
    SIGTERM that Python does not turn into an exception): their tag names the process, which is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        tag = name.split("-")[0]
        if not (tag.startswith("gdt") and tag[3:].isdigit()) or _alive(int(tag[3:])):
            continue
        _kill_namespace(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
