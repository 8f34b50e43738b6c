"""A deep GPT's memory from two shallow traces: a planner's trace costs what a step of 4 and 5 blocks does.

A step's memory is, block for block, the same: at any point of it, what is held is a part that
does not depend on depth (embeddings, head, logits and their gradient, the batch, a block's
buffers in flight: an FSDP all-gather, a recomputed block under checkpointing) and a part per
block (weights, gradients and optimizer state, saved activations, a share of DDP's buckets). The
trace cuts the step where each block's forward and backward begin and end (`trace._Pieces`) and
keeps each piece's peak. Within a sweep over the blocks, the pieces of one kind grow or shrink by
the same bytes from block to block, so their largest is at an end of the sweep: a piece at the
first two or last two blocks, or outside them. Those pieces exist at every depth from 4 blocks on,
and each one's bytes, category by category, are affine in depth L:

    piece(L) = piece(4) + (L - 4) x (piece(5) - piece(4))

The step's peak is the largest piece at depth L. Extrapolating the peak alone would be wrong:
which piece holds it moves with depth (the end of backward, holding every block's gradient,
overtakes the start of backward, holding the logits' gradient, as a model deepens at a small
micro-batch). The pieces between ("mid") are dropped: they lie between the ends of their sweep.
Tested against full traces (tests/unit/test_memory_depth.py); the accuracy suite measures the
extrapolated estimates against real steps. FLOPs, affine in depth as they are, are counted the
same way (`plan.py`). A pipeline's stages are traced whole.
"""

from __future__ import annotations

import dataclasses

from .. import models
from ..config import Config, with_sets

SHALLOW = (4, 5)  # blocks traced; a model of at most the deeper is traced whole


def blocks_of(cfg: Config) -> int | None:
    """The model's repeated blocks, when a trace can take it at another depth (a GPT); else None."""
    spec = models.from_config(cfg)
    return spec.config.n_layer if spec.family == "gpt" else None


def at_depth(cfg: Config, n_layer: int) -> Config:
    return with_sets(cfg, [f"model.n_layer={n_layer}"])


def extrapolate(shallow, deeper, steps: int):
    """shallow + steps x (deeper - shallow), through the dicts and dataclasses of byte counts a trace gives;
    the pieces of a trace between the ends of a sweep ("mid") are dropped."""
    if isinstance(shallow, dict):
        keys = [k for k in deeper if " mid " not in k] if isinstance(next(iter(deeper), None), str) else list(deeper)
        if sorted(keys) != sorted(shallow):
            raise RuntimeError(f"traces at two depths differ in their pieces: {sorted(shallow)} and {sorted(keys)}")
        return {k: extrapolate(shallow[k], deeper[k], steps) for k in keys}
    if dataclasses.is_dataclass(shallow):
        return dataclasses.replace(shallow, **{f.name: extrapolate(getattr(shallow, f.name), getattr(deeper, f.name),
                                                                   steps) for f in dataclasses.fields(shallow)})
    return shallow + steps * (deeper - shallow)


def by_depth(cfg: Config, trace, run_all=map):
    """`trace(cfg)`, from traces at `SHALLOW` blocks when the model has more; `trace` takes a config and
    returns figures `extrapolate` can combine; `run_all(trace, configs)` runs the two (side by side)."""
    blocks = blocks_of(cfg)
    if blocks is None or blocks <= SHALLOW[-1]:
        return trace(cfg)
    shallow, deeper = run_all(trace, [at_depth(cfg, d) for d in SHALLOW])
    return extrapolate(shallow, deeper, blocks - SHALLOW[0])
