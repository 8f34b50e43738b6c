"""The rendezvous: every rank checks in on the job's store before the process group forms, so a rank that
never arrives is named, within parallel.timeout_s, instead of "1/2 clients joined".

torch's own rendezvous counts the processes that joined, not which ones; its store cannot say who
is missing. Each rank here writes its own key and waits for everyone's: the keys that are not
there are the late ranks.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import UserError

_POLL_S = 0.2


def tcp_store(host: str, port: int, rank: int, world: int, timeout_s: int) -> dist.Store:
    """The job's key-value store, hosted by rank 0 at host:port (what torch's env:// makes, but not waiting
    for a count of clients: `check_in` waits for named ranks instead)."""
    try:
        return dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, ValueError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        who = "could not host" if rank == 0 else "could not reach"
        late = "" if rank == 0 else "; rank 0, which hosts it, never arrived or the address is wrong"
        raise UserError(f"rank {rank} of {world} {who} the rendezvous at {host}:{port} within {timeout_s} s "
                        f"({str(e).splitlines()[0]}){late}: check that every node can reach it, or raise "
                        f"--set parallel.timeout_s") from e


def check_in(store: dist.Store, rank: int, world: int, timeout_s: int) -> None:
    """Mark this rank present and wait up to `timeout_s` for all the others; name the ones that never came."""
    store.set(f"gpudl/joined/{rank}", str(time.time()))
    keys = [f"gpudl/joined/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check(keys):
            return
        time.sleep(_POLL_S)
    late = [r for r, key in enumerate(keys) if not store.check([key])]
    if not late:
        return
    names = ", ".join(map(str, late))
    raise UserError(f"the rendezvous (check-in on the job's store) timed out after {timeout_s} s on rank {rank}: "
                    f"rank{'s' if len(late) > 1 else ''} {names} never arrived. Look at that rank's output and "
                    f"launch; if such a wait is expected, raise --set parallel.timeout_s (now {timeout_s})")
