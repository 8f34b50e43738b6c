"""What text costs once and is kept in the cache (a trained tokenizer, a token file): its key, a lock
so that one process makes it while the others (a job's ranks) wait and then read it, and the
progress of the work on stderr (stdout may be a `--json` answer)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """Held while `path` is checked and made: of the processes that want it, one makes it."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks: each process may make the file; the atomic rename keeps it whole
        yield
        return
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class WorkBar:
    """A live bar of bytes done on a terminal; elsewhere (a log, CI) a line as the work starts and ends."""

    def __init__(self, what: str, total: int, show: bool):
        self.what, self.show, self.t0 = what, show, time.perf_counter()
        self.console = Console(stderr=True)
        live = show and self.console.is_terminal
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
                                  transient=True, disable=not live)
        self._task = self._progress.add_task(what, total=total)

    def __enter__(self) -> WorkBar:
        if self.show and not self.console.is_terminal:
            self.console.print(f"{self.what} ...", markup=False, highlight=False)
        self._progress.start()
        return self

    def advance(self, n: int) -> None:
        self._progress.advance(self._task, n)

    def stage(self, what: str) -> None:
        """A stage whose end cannot be foreseen (a BPE's merges): the bar pulses."""
        self._progress.update(self._task, description=what, total=None)

    def __exit__(self, *exc) -> None:
        self._progress.stop()
        if self.show and exc[0] is None:
            self.console.print(f"{self.what}: {time.perf_counter() - self.t0:.1f} s", markup=False, highlight=False)
