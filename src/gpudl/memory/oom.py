"""When memory runs out, or nothing fits: where the bytes go, and the fixes ranked by what each saves.

Each fix is the job as asked with one change, estimated as the job itself is (`estimate.py`), so
its saving is the difference of two traces: precision (bf16-mixed), activation checkpointing,
sharding (FSDP over the job's processes, or over two where there is one), FSDP's CPU offload (on
an accelerator: weights, gradients and optimizer state in host memory), and half the
micro-batch (twice the accumulation: the global batch is kept). Recovery itself (halve and redo
the step) is the training loop's (`training/loop.py`, `training/micro.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..config import Config, with_sets
from ..distributed.parallelize import checkpoint_mode
from .estimate import Estimate, dims_of
from .fake_jobs import FakeJobs
from .offload import offloads_to_host

GiB = 2**30


@dataclass(frozen=True)
class Fix:
    name: str                 # "bf16-mixed", "activation checkpointing", "FSDP over 2 processes", "micro-batch 8 -> 4"
    sets: tuple[str, ...]     # the --set items that apply it
    world: int                # processes the fixed job runs on
    peak: int                 # its predicted peak per rank, bytes
    saving: int               # bytes per rank, against the job as asked


def _candidates(cfg: Config, world: int) -> list[tuple[str, list[str], int]]:
    t, out = cfg.train, []
    if t.precision in ("fp32", "auto"):
        out.append(("bf16-mixed", ["train.precision=bf16-mixed"], world))
    mode = checkpoint_mode(t.activation_checkpointing)
    if mode != "full":
        out.append(("activation checkpointing", ["train.activation_checkpointing=true"], world))
    if mode == "off":  # saves less, and recomputes no matmul
        out.append(("selective activation checkpointing", ["train.activation_checkpointing=selective"], world))
    dims = dims_of(cfg, world)
    if dims.dp_shard == 1 and dims.tp == 1 and dims.pp == 1:
        shards = max(world, 2)
        out.append((f"FSDP over {shards} processes", ["parallel.dp_replicate=1", f"parallel.dp_shard={shards}"], shards))
    if not cfg.parallel.fsdp_cpu_offload and offloads_to_host(with_sets(cfg, ["parallel.fsdp_cpu_offload=true"])):
        out.append(("FSDP CPU offload", ["parallel.fsdp_cpu_offload=true"], world))  # state in host memory
    if t.batch_size > 1:
        out.append((f"micro-batch {t.batch_size} -> {t.batch_size // 2}",
                    [f"train.batch_size={t.batch_size // 2}", f"train.grad_accum={t.grad_accum * 2}"], world))
    return out


def fixes(cfg: Config, world: int, asked: Estimate) -> list[Fix]:
    """Every fix that applies to `cfg` on `world` processes, the largest saving first."""
    found = []
    with contextlib.ExitStack() as stack:
        by_world: dict[int, FakeJobs] = {}
        for name, sets, w in _candidates(cfg, world):
            if w not in by_world:
                by_world[w] = stack.enter_context(FakeJobs(w))
            peak = by_world[w].estimate(with_sets(cfg, sets)).peak
            found.append(Fix(name, tuple(sets), w, peak, asked.peak - peak))
    return sorted(found, key=lambda f: -f.saving)


def fixes_line(found: list[Fix]) -> str:
    """`bf16-mixed -3.10 GiB · activation checkpointing -5.00 GiB · ...` (savings per device)."""
    return " · ".join(f"{f.name} {-f.saving / GiB:+.2f} GiB" for f in found if f.saving > 0) or "none found"


def breakdown_line(e: Estimate) -> str:
    shown = {k: v for k, v in e.parts.items() if v >= 2**20}
    return ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(shown.items(), key=lambda kv: -kv[1])) + " GiB"


def explain(cfg: Config, world: int, usable: int | None = None) -> str:
    """Lines for a job that does not fit: its predicted peak by part, then the fixes ranked."""
    with FakeJobs(world) as jobs:
        asked = jobs.estimate(cfg)
    room = f" of {usable / GiB:.2f} GiB usable" if usable else ""
    return (f"predicted peak per process {asked.peak / GiB:.2f} GiB{room} ({breakdown_line(asked)}); "
            f"fixes, by predicted saving: {fixes_line(fixes(cfg, world, asked))}")
