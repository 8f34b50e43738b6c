"""FSDP's CPU offload in the memory estimate: what stays in host memory, and whether it is apart from the device's.

With `parallel.fsdp_cpu_offload` FSDP keeps the shards of the weights and gradients and the
optimizer state in host memory, and the update runs there. On an accelerator that memory is not
the device's: a trace (which runs on the CPU's fake tensors either way) files those bytes as
"host", and the device's peak leaves them out. On the CPU both are one memory, and nothing is apart.
"""

from __future__ import annotations

from ..config import Config

# torch's FSDPMemTracker kinds that offload keeps on the host (and, in the update, "TEMP" too)
OFFLOADED = frozenset({"SHARDED_PARAM", "SHARDED_GRAD", "OPT"})


def in_the_update(host: frozenset) -> frozenset:
    """The kinds on the host while the update runs: with offload it runs there, its temporaries too."""
    return host | {"TEMP"} if host else host


def on_device(parts: dict[str, int]) -> int:
    """Bytes in the device's memory: all but what CPU offload keeps on the host."""
    return sum(v for k, v in parts.items() if k != "host")


def offloads_to_host(cfg: Config) -> bool:
    """Whether FSDP's CPU offload keeps its shards in host memory apart from the device's: on an
    accelerator (`run.device`; "auto": the best this machine has), not on the CPU, where both are one."""
    if not cfg.parallel.fsdp_cpu_offload:
        return False
    kind = cfg.run.device.split(":")[0]
    if kind == "auto":
        from ..device import available

        kind = available()[0]
    return kind != "cpu"
