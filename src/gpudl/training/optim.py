"""AdamW (fused where the device has a fused kernel) and the warm-up + cosine schedule.

>>> import torch
>>> sched = lr_lambda(warmup=10, total=100, floor=0.1)
>>> round(sched(0), 3), sched(10), round(sched(100), 3)
(0.091, 1.0, 0.1)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import OptimConfig

# Device types with a fused AdamW kernel in torch (one kernel for all parameters).
FUSED_DEVICE_TYPES = {"cuda", "xpu", "mps", "cpu"}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (weights, embeddings); leave vectors (norms, biases) alone."""
    decay, no_decay = [], []
    for p in model.parameters():  # shared (tied) parameters appear once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str) -> torch.optim.AdamW:
    fused = device_type in FUSED_DEVICE_TYPES if cfg.fused == "auto" else bool(cfg.fused)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             fused=fused or None, foreach=None if fused else True)


def lr_lambda(warmup: int, total: int, floor: float):
    """Multiplier of the peak lr: linear warm-up, then cosine decay down to `floor`."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, max_steps, cfg.min_lr_ratio))


def set_total_steps(scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimConfig, max_steps: int) -> None:
    """Let the cosine end at `max_steps` instead (a time budget decided it after the run's first steps).

    The warm-up does not depend on the total, so steps taken within it were as they would have been."""
    scheduler.lr_lambdas = [lr_lambda(cfg.warmup_steps, max_steps, cfg.min_lr_ratio)] * len(scheduler.lr_lambdas)
