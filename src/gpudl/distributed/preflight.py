"""Everything about a training job that can be wrong before any process starts, checked in one place.

The launcher calls `check_job` before it starts N workers, so that a mistake is said once, not N
times (or N times per restart); every worker calls it too, for a job that torchrun or SLURM
started directly. Model checks come before the degrees are counted against the processes: no
number of processes fixes a model that cannot be split.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .. import models
from ..config import Config
from ..config.sizes import parse_size
from ..errors import UserError
from .float8 import check_float8_layout
from .mesh import ParallelDims


def check_job(cfg: Config, world: int, precision_name: str, model: nn.Module | None = None) -> None:
    """Refuse, in one line, a job whose model, degrees or data cannot run on `world` processes.
    `model`: the job's (a user's module in `fit`); by default the recipe's, built on the meta device."""
    p = cfg.parallel
    if precision_name == "fp8":
        check_float8_layout(p.tp)
    if p.tp > 1 or p.pp > 1:
        meta = model if model is not None else models.build_meta(models.from_config(cfg))
        if p.tp > 1:
            from .tensor import check_tp

            check_tp(meta, p.tp, p.tp_sequence_parallel)
        if p.pp > 1:
            from .pipeline import check_pipeline

            check_pipeline(meta, p, cfg.train.batch_size, precision_name)
    ParallelDims.resolve(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, world=world)
    if cfg.train.memory_limit:
        parse_size(cfg.train.memory_limit, "train.memory_limit")
    if cfg.data.path and cfg.data.path != "sklearn:digits" and not Path(cfg.data.path).expanduser().exists():
        raise UserError(f"data.path {cfg.data.path!r} does not exist on this machine: point it at your data")
