"""`gpudl.plan`: will this job fit, and what is the fastest way to make it fit?"""

from __future__ import annotations

from ..config import Config, load_config
from ..config.sizes import parse_size
from ..memory.plan import Plan, local_machine, plan as plan_layouts, target_machine


def plan(cfg: Config | None = None, *, target: str | None = None, nproc_per_node: int = 1, nnodes: int = 1,
         memory_limit: str | int | None = None, device: str = "auto") -> Plan:
    """Trace one training step per candidate layout on fake tensors (nothing is allocated) and rank them.

    Args:
        cfg: the job (a recipe with its settings: `gpudl.load_config`); None: the default recipe.
        target: plan for a named GPU instead of this machine ("h100-80gb", "a100-40gb", ...:
            `gpudl plan --help` lists them); None: this machine's `device`.
        nproc_per_node: processes (devices) per machine.
        nnodes: machines.
        memory_limit: usable memory per device ("12GiB" or bytes), in place of the device's own.
        device: which of this machine's devices ("auto": the best one), when no `target` is given.

    Returns:
        Plan: its `candidates` (each with its `estimate.parts` and why it was rejected) and the
        `winner`, whose `sets` apply it (`--set` strings).

    >>> import gpudl
    >>> p = gpudl.plan(gpudl.load_config("gpt-tiny"), target="a100-40gb")
    >>> p.winner.describe()
    'one process · micro-batch 32 x 1'
    >>> big = gpudl.plan(gpudl.load_config("gpt2-124m"), target="a100-40gb", nproc_per_node=8)  # doctest: +SKIP
    """
    cfg = cfg if cfg is not None else load_config(None)
    limit = parse_size(memory_limit) if isinstance(memory_limit, str) else memory_limit
    machine = target_machine(target, nproc_per_node, nnodes, limit) if target else \
        local_machine(device, nproc_per_node, nnodes, limit)
    return plan_layouts(cfg, machine)
