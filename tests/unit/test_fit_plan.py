"""gpudl.fit(plan="auto"): a user's own module is traced on fake tensors, and the micro-batch it trains
with runs under the enforced memory limit it was planned for, keeping the samples per step."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import gpudl
from gpudl.config import with_sets
from gpudl.device import cpu_info
from gpudl.memory.trace import trace_module
from gpudl.run.fit import _config
from gpudl.distributed.session import Session


class Residual(torch.nn.Module):
    """A user's module with a list of blocks (so activation checkpointing can apply to it)."""

    def __init__(self, width: int = 512, depth: int = 4):
        super().__init__()
        self.inp = torch.nn.Linear(32, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                          for _ in range(depth))
        self.out = torch.nn.Linear(width, 10)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def data(n: int = 2048):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def predicted_peak(micro: int, batch: int) -> int:
    cfg = with_sets(_config(None, train={"precision": "fp32"}),
                    [f"train.batch_size={micro}", f"train.grad_accum={batch // micro}"])
    x, y = data()
    loss = lambda model, b: F.cross_entropy(model(b[0]), b[1])  # noqa: E731 -- fit's own wrapping of F.cross_entropy
    return sum(trace_module(Residual(), loss, cfg, Session(cpu_info()), (x[:batch], y[:batch])).values())


def fit(**kw):
    torch.manual_seed(0)
    return gpudl.fit(Residual(), data(), loss=F.cross_entropy, max_steps=4, batch_size=512, lr=1e-3,
                     precision="fp32", log_every=1, device="cpu", **kw)  # planned from a CPU trace


def test_the_planned_micro_batch_trains_under_its_limit_with_the_same_samples_per_step(capsys):
    limit = (predicted_peak(512, 512) + predicted_peak(128, 512)) // 2
    planned = fit(plan="auto", memory_limit=limit)
    said = capsys.readouterr().out
    micro, accum = map(int, re.search(r"Plan: micro-batch (\d+) x (\d+)", said).groups())
    assert micro < 512 and micro * accum == 512, said  # smaller than asked, the samples per step kept
    assert [r for r in planned.records if r["kind"] == "oom"] == []  # the real limit was never passed
    direct = fit(quiet=True)  # the whole 512 rows in one micro-batch, no limit: the same samples each step
    losses = [r["loss"] for r in planned.records if r["kind"] == "train"]
    assert losses == pytest.approx([r["loss"] for r in direct.records if r["kind"] == "train"], abs=1e-5)


def test_nothing_fitting_is_one_line():
    with pytest.raises(gpudl.UserError, match="no micro-batch of Residual fits"):
        fit(plan="auto", memory_limit="1MiB", quiet=True)


def test_on_an_accelerator_a_module_larger_than_its_memory_is_planned_with_cpu_offload():
    """Where no micro-batch fits on the device (here: less than the 16 bytes a parameter of fp32 weights,
    gradients and AdamW's moments), fit's plan keeps them in host memory: FSDP's CPU offload over this one
    process, traced on a fake group of one that is gone afterwards. Planned as for a GPU (run.device), on
    the CPU's fake tensors; the CPU itself never offloads (one memory)."""
    import torch.distributed as dist

    from gpudl.memory.auto import _fitting_micro_batch

    cfg = with_sets(_config(None, train={"precision": "fp32"}), ["train.batch_size=512", "run.device=cuda"])
    n = sum(p.numel() for p in Residual().parameters())
    x, y = data()
    loss = lambda model, b: F.cross_entropy(model(b[0]), b[1])  # noqa: E731
    chosen = _fitting_micro_batch(Residual(), loss, (x[:512], y[:512]), cfg, Session(cpu_info()), 12 * n)
    assert chosen.get("offload") is True, chosen
    assert "with FSDP's CPU offload" in chosen["said"] and not dist.is_initialized()
    on_cpu = with_sets(cfg, ["run.device=cpu"])
    with pytest.raises(gpudl.UserError, match="no micro-batch of Residual fits"):  # the CPU's host memory is its
        _fitting_micro_batch(Residual(), loss, (x[:512], y[:512]), on_cpu, Session(cpu_info()), 12 * n)  # device's
