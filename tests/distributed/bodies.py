"""What each rank of a distributed test runs (imported by _worker.py in every process)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from rich.console import Console
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

# A GPT small enough for many processes on two cores, trained in fp32 so sums can be compared.
TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.block_size=32", "train.batch_size=4",
        "train.max_steps=10", "train.log_every=1", "train.eval_every=5", "train.eval_batches=2",
        "train.precision=fp32", "sample.tokens=0", "log.progress=false", "log.plot=false", "optim.warmup_steps=2"]


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as one whole tensor on rank 0 (sharded ones gathered); {} elsewhere."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train_tiny(sets: list[str], resume: str | None = None) -> dict:
    from gpudl.config import load_config
    from gpudl.run import train

    cfg = load_config(None, [*TINY, *sets])
    result = train(cfg, resume=resume, console=Console(quiet=True))
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "evals": [r for r in result.records if r["kind"] == "eval"],
            "params": full_params(result.model), "summary": result.summary, "rank": dist.get_rank()}
