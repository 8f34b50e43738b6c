"""Random streams across a change of world size: restored where the world is the one that saved them,
re-seeded from (run seed, rank, step) where it is not.

Each rank saves its own RNG states under `rng_<rank>`. Loading them is a DCP load, so a
collective: every rank must enter it or none. Whether a rank "has" its key cannot be the test
(after 1 -> 2 ranks, rank 0 has one and rank 1 has none, and the two wait for each other), so the
decision is taken once, from the world size that saved the checkpoint, which rank 0 reads from
the vetted files and broadcasts with its verdict.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .files import damaged

_RNG_KEY = re.compile(r"rng_(\d+)\.")


def rng_ranks(metadata: Metadata) -> set[int]:
    """The ranks whose RNG states the checkpoint holds (its keys are `rng_<rank>.cpu`, `rng_<rank>.device`)."""
    return {int(m.group(1)) for key in metadata.state_dict_metadata if (m := _RNG_KEY.match(key))}


def saved_world(ckpt: Path, state: dict, metadata: Metadata) -> int | None:
    """How many processes saved `ckpt`: state.json's `world_size`, or, in a checkpoint written before it
    was recorded, the ranks with RNG states (None when there are none: nothing to restore)."""
    ranks = rng_ranks(metadata)
    world = state.get("world_size")
    if world is None:
        return len(ranks) if ranks == set(range(len(ranks))) and ranks else None
    if type(world) is not int or world < 1:
        raise damaged(ckpt, f"state.json's world_size must be an integer >= 1, got {world!r}")
    if ranks != set(range(world)):
        raise damaged(ckpt, f"state.json says {world} processes saved it, but it holds the RNG states of "
                            f"ranks {sorted(ranks)}")
    return world


def restores(saved: int | None, world: int) -> bool:
    """Whether this job restores the saved RNG states (the same on every rank: both numbers are)."""
    return saved == world


def derived_seed(seed: int, rank: int, step: int) -> int:
    """A seed of its own for each (run seed, rank, step): independent streams per rank, the same on a rerun."""
    digest = hashlib.sha256(f"gpudl-rng/{seed}/{rank}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: what every torch generator accepts


def reseed(seed: int, rank: int, step: int) -> None:
    """Seed this process's CPU and accelerator generators for `rank` resuming at `step`."""
    torch.manual_seed(derived_seed(seed, rank, step))  # seeds every device's default generator too


def rng_note(saved: int | None, world: int) -> str | None:
    """What resuming does to the random streams, in one line; None when they are restored as saved."""
    if restores(saved, world):
        return None
    was = f"was saved by {saved} process{'es' if saved != 1 else ''}" if saved else "holds no RNG states"
    return (f"The checkpoint {was} and resumes on {world}: random streams (dropout) are re-seeded from "
            f"run.seed, the rank and the step, so they differ from an uninterrupted run's")
