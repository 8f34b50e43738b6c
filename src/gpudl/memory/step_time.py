"""Predicted seconds per optimizer step of a candidate plan, for ranking (the absolute figure is indicative).

compute = the step's FLOPs (counted once with torch's FLOP counter; with checkpointing, plus the
blocks' forward, which runs again) / (processes x the precision's peak x ASSUMED_MFU), plus one host
overhead per micro-step on accelerators.

Communication, not overlapped (a conservative choice), at the link's bandwidth: DDP all-reduces the
gradients once a step, 2 (n-1)/n of their bytes; FSDP all-gathers the parameters in forward and
backward of every micro-batch and reduce-scatters the gradients once, (n-1)/n of their bytes each
(of one stage's parameters beside a pipeline); tensor parallelism all-reduces a block's activations
four times a micro-batch. A pipeline adds its bubble and its point-to-point sends (`pipeline.py`).

FSDP's CPU offload on an accelerator adds, over the device's host link (PCIe), its copies: the
rank's shard of the weights to the device at each all-gather (forward, and backward again when
resharded after forward) and of the gradients to the host at each reduce-scatter (every
micro-batch: `distributed/fsdp.py`); and the update, run on the host at HOST_UPDATE_PARAMS_S.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from .. import models
from ..config import Config, with_sets
from ..training.precision import param_dtype_of
from .pipeline import pipeline_seconds

ASSUMED_MFU = 0.4             # of the precision's peak, for predicted step times
MICRO_STEP_OVERHEAD_S = 1e-3  # host time to launch a micro-step's kernels on an accelerator
NODE_LINK_B_S = 25e9          # between nodes: 200 Gb/s InfiniBand or RoCE, each way
# AdamW on the host (CPU offload), parameters a second: below the 1.7e9 torch's fused CPU AdamW did on
# 2 cores of a Xeon with AVX512 (2026-12-04; a GPU server's host has more cores, a laptop's fewer)
HOST_UPDATE_PARAMS_S = 1e9


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per sample: of a training step, and of what activation checkpointing runs again (the
    blocks' forward). A dataclass of numbers, so that `depth.by_depth` extrapolates it."""

    train: int
    recompute: int


def flops_per_sample(cfg: Config) -> StepFlops:
    from .trace_cache import cached

    return StepFlops(**cached(cfg, 1, lambda: dataclasses.asdict(_count_flops_per_sample(cfg)), "flops"))


def _count_flops_per_sample(cfg: Config) -> StepFlops:
    from ..distributed.parallelize import block_units
    from ..observe.flops import count_step_flops, meta_batch
    from ..training.job import model_and_shapes

    spec, data = model_and_shapes(cfg)
    one = meta_batch(tuple(t[:1] for t in data.train.batch(0)))
    model = models.build_meta(spec)
    return StepFlops(*count_step_flops(model, one, models.loss_for(spec), block_units(model)))


def step_seconds(c, cfg: Config, machine, flops: StepFlops, batch: int) -> float:
    """Predicted seconds per optimizer step of the candidate `c` on `machine` (`plan.Candidate`,
    `plan.Machine`; the module docstring gives the model)."""
    from ..device.peak import peak_key

    peak = machine.peak_flops.get(peak_key(cfg.train.precision)) or machine.peak_flops["fp32"]
    per_sample = flops.train + (flops.recompute if c.activation_checkpointing else 0)
    compute = per_sample * batch / (machine.world * peak * ASSUMED_MFU)
    overhead = c.grad_accum * MICRO_STEP_OVERHEAD_S if machine.device_type != "cpu" else 0.0
    link = machine.link_b_s if machine.nnodes == 1 else min(machine.link_b_s, NODE_LINK_B_S)
    job = with_sets(cfg, c.sets)
    bubble_and_sends = pipeline_seconds(job, compute, link)
    return compute + overhead + _communication_seconds(c, cfg, machine) + bubble_and_sends + \
        _offload_seconds(c, job, machine)


def _offload_seconds(c, job: Config, machine) -> float:
    """CPU offload's copies over the host link and its update on the host (the module docstring)."""
    from .estimate import dims_of
    from .offload import offloads_to_host

    if not offloads_to_host(job):
        return 0.0
    spec = models.from_config(job)
    d = dims_of(job, machine.world)
    shard = models.parameter_count(spec) / (d.dp_shard * d.tp * d.pp)
    state_bytes = param_dtype_of(job.train.precision).itemsize  # the host's weights and gradients
    gathers = 2 if job.parallel.fsdp_reshard_after_forward else 1
    copies = c.grad_accum * (gathers + 1) * shard * state_bytes / machine.host_b_s
    return copies + shard / HOST_UPDATE_PARAMS_S


def _communication_seconds(c, cfg: Config, machine) -> float:
    spec = models.from_config(cfg)
    n_params = models.parameter_count(spec)
    w = machine.world
    link = machine.link_b_s if machine.nnodes == 1 else min(machine.link_b_s, NODE_LINK_B_S)
    compute_bytes = 2 if cfg.train.precision.startswith(("bf16", "fp16")) else 4
    tp = int(c.settings.get("parallel.tp", 1))
    if c.strategy == "DDP":
        return 2 * (w - 1) / w * n_params * 4 / link
    shard = int(c.settings.get("parallel.dp_shard", 1))
    pp = int(c.settings.get("parallel.pp", 1))  # an FSDP group beside a pipeline holds one stage's weights
    fsdp = 0.0 if shard == 1 else ((2 * c.grad_accum + 1) * (shard - 1) / shard * n_params / tp / pp * compute_bytes
                                   / link)
    if tp == 1:
        return fsdp
    tokens = c.micro_batch * getattr(spec.config, "block_size", 1)
    per_block = 4 * 2 * (tp - 1) / tp * tokens * spec.config.d_model * compute_bytes
    return fsdp + c.grad_accum * spec.config.n_layer * per_block / machine.link_b_s
