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
from gpudl.config import Config, DataConfig, ParallelConfig, RunConfig, TrainConfig
from gpudl.data import build_data
from gpudl.observe.metrics import Throughput
from gpudl.observe.sinks import FileSink
from gpudl.training.job import Task, build_job
from gpudl.training.loop import TrainState, train_loop
from gpudl.run.monitor import Monitor
from gpudl.training.precision import make_precision
from gpudl.distributed.session import plan_parallel, start_session

STEPS, BATCH = 5, 16


def ddp_worker(rounds: int) -> None:
    session = start_session(RunConfig(), Console(quiet=True))
    spec = models.resolve("gpt-tiny")
    plan_parallel(session, ParallelConfig(dp_replicate=2))
    prec = make_precision("auto", session.device)
    dev = session.device.torch_device
    rank, world = session.dp
    data = build_data(DataConfig(kind="synthetic"), spec, BATCH, seed=rank)
    batches = [tuple(t.to(dev) for t in data.train.batch(k)) for k in range(STEPS)]
    total = 2 * (rounds + 1) * STEPS
    cfg = TrainConfig(max_steps=total, batch_size=BATCH, compile=False)
    loss_fn = models.loss_for(spec)
    # gpudl's own assembly (DDP, attention kernel, optimizer, schedule); the raw loop steps the same objects
    job = build_job(models.build(spec, dev, prec.param_dtype, seed=0), Config(train=cfg), session, prec,
                    Task(loss_fn))
    ddp, opt, sched = job.model, job.optimizer, job.scheduler
    sinks = [FileSink(Path(tempfile.mkdtemp()))] if session.is_writer else []
    monitor = Monitor(session=session, train=cfg, sinks=sinks,
                      throughput=Throughput(BATCH * world, data.units_per_sample, 1.0, 1.0, world=world))
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
