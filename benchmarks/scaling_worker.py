"""One process of `scaling.py --part ddp`: gpudl's loop and a raw DDP loop on the same objects."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from overhead import raw_steps, timed
from gpudl import models
from gpudl.config import DataConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from gpudl.data import build_data
from gpudl.distributed.parallelize import parallelize
from gpudl.observe.metrics import Throughput
from gpudl.training.monitor import Monitor
from gpudl.training.optim import make_optimizer, make_scheduler
from gpudl.training.precision import make_precision
from gpudl.training.session import plan_parallel, start_session
from gpudl.observe.sinks import FileSink
from gpudl.training.loop import Job, TrainState, train_loop

STEPS, BATCH = 5, 16


def ddp_worker(rounds: int) -> None:
    session = start_session(RunConfig(), Console(quiet=True))
    spec = models.resolve("gpt-tiny")
    plan_parallel(session, ParallelConfig(dp_replicate=2), n_params=0)
    prec = make_precision("auto", session.device)
    dev = session.device.torch_device
    rank, world = session.dp
    data = build_data(DataConfig(kind="synthetic"), spec, BATCH, seed=rank)
    batches = [tuple(t.to(dev) for t in data.train.batch(k)) for k in range(STEPS)]
    placed = parallelize(models.build(spec, dev, prec.param_dtype, seed=0), activation_checkpointing=False,
                         compile=False, dims=session.dims, mesh=session.mesh, precision_name=prec.name, device=dev)
    ddp, loss_fn = placed.model, models.loss_for(spec)
    total = 2 * (rounds + 1) * STEPS
    cfg = TrainConfig(max_steps=total, batch_size=BATCH)
    opt = make_optimizer(ddp, OptimConfig(), dev.type)
    sched = make_scheduler(opt, OptimConfig(), total)
    job = Job(model=ddp, loss_fn=loss_fn, optimizer=opt, scheduler=sched, precision=prec, batches=iter(()),
              grad_sync=placed.grad_sync, clip_norm=placed.clip_norm)
    sinks = [FileSink(Path(tempfile.mkdtemp()))] if session.is_writer else []
    monitor = Monitor(throughput=Throughput(BATCH * world, data.units_per_sample, 1.0, 1.0, world=world), device=dev,
                      log_every=cfg.log_every, max_steps=total, sinks=sinks, reduce=session.reduce_mean)
    state = TrainState()

    def ours():
        job.batches = iter(batches)
        train_loop(job, dataclasses.replace(cfg, max_steps=state.step + STEPS), state, monitor)

    def theirs():
        raw_steps(ddp, opt, sched, batches, prec.autocast, loss_fn, cfg.grad_clip)

    ratios = []
    for r in range(rounds + 1):  # round 0 warms up both
        pair = (ours, theirs) if r % 2 else (theirs, ours)
        t = {fn: timed(fn, dev) for fn in pair}
        ratios.append(t[ours] / t[theirs])
    ratios = torch.tensor(ratios[1:])
    dist.all_reduce(ratios)  # both processes' view of each round
    if session.is_writer:
        r = (ratios / world).tolist()
        q = statistics.quantiles(r, n=4)
        print(f"gpudl DDP vs raw DDP, {world} processes, {prec.name}: {100 * (statistics.median(r) - 1):+.2f}% "
              f"(median of {len(r)} rounds of {STEPS} steps; quartiles {100 * (q[0] - 1):+.2f}% .. "
              f"{100 * (q[2] - 1):+.2f}%; goal <= +1%)")
    dist.destroy_process_group()
