"""gpudl's training loop vs a minimal raw PyTorch loop: same model, batches, optimizer, precision.

Both loops run in this one process, interleaved in short rounds (the order alternates each
round), and both drive the very same model, optimizer and scheduler objects over the same
batches already on the device: separate copies differ by a few percent in speed on their own
(memory placement), which would drown a 1% question. The gpudl side is the real thing:
`train_loop` with its finiteness guard and the run's metrics monitor (throughput, MFU,
memory, JSONL/CSV files). The figure is the median over rounds of (gpudl time / raw time) - 1.

    python benchmarks/overhead.py                      # gpt-tiny, auto device and precision
    python benchmarks/overhead.py --model resnet18 --batch-size 32 --rounds 20
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpudl import models
from gpudl.config import Config, DataConfig, TrainConfig
from gpudl.data import build_data
from gpudl.device import detect, synchronize
from gpudl.device.host import keep_freed_memory
from gpudl.observe.metrics import Throughput
from gpudl.observe.sinks import FileSink
from gpudl.training.job import Task, build_job
from gpudl.training.loop import TrainState, train_loop
from gpudl.training.monitor import Monitor
from gpudl.training.precision import make_precision
from gpudl.training.session import Session


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=5, help="steps per loop per round")
    return p.parse_args()


def raw_steps(model, opt, sched, batches, autocast, loss_fn, clip: float) -> None:
    """The minimal loop a person writes by hand."""
    for batch in batches:
        with autocast():
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def timed(fn, device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    args = parse()
    info = detect(args.device)
    if info.type == "cpu":
        keep_freed_memory()  # what a gpudl run does on the CPU; both loops share this process and get it
    prec = make_precision(args.precision, info)
    dev = info.torch_device
    spec = models.resolve(args.model)
    data = build_data(DataConfig(kind="synthetic"), spec, args.batch_size, seed=0)
    batches = [tuple(t.to(dev) for t in data.train.batch(k)) for k in range(args.steps)]
    loss_fn = models.loss_for(spec)
    total = 2 * (args.rounds + 1) * args.steps
    train_cfg = TrainConfig(max_steps=total, batch_size=args.batch_size)
    session = Session(info)
    # gpudl's own assembly (attention kernel, optimizer, schedule); the raw loop steps the same objects
    job = build_job(models.build(spec, dev, prec.param_dtype, seed=0), Config(train=train_cfg), session, prec,
                    Task(loss_fn))
    model, opt, sched = job.model, job.optimizer, job.scheduler
    run_dir = Path(tempfile.mkdtemp(prefix="gpudl-overhead-"))
    monitor = Monitor(session=session, train=train_cfg, sinks=[FileSink(run_dir)],
                      throughput=Throughput(args.batch_size, data.units_per_sample, 1.0, 1.0))
    state = TrainState()
    print(f"Using device: {info.label} · precision {prec.name} · {args.model} · batch {args.batch_size} · "
          f"{args.rounds} rounds x {args.steps} steps")

    def run_ours():
        job.batches = iter(batches)
        train_loop(job, dataclasses.replace(train_cfg, max_steps=state.step + args.steps), state, monitor)

    def run_theirs():
        raw_steps(model, opt, sched, batches, prec.autocast, loss_fn, train_cfg.grad_clip)

    ratios = []
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        pair = (run_ours, run_theirs) if r % 2 else (run_theirs, run_ours)
        t = {fn: timed(fn, dev) for fn in pair}
        if r:
            ratios.append(t[run_ours] / t[run_theirs])
            print(f"round {r:>2}: gpudl {1e3 * t[run_ours] / args.steps:7.2f} ms/step · raw "
                  f"{1e3 * t[run_theirs] / args.steps:7.2f} ms/step · ratio {ratios[-1]:.4f}")
    q = statistics.quantiles(ratios, n=4)
    print(f"overhead: {100 * (statistics.median(ratios) - 1):+.2f}% (median of {len(ratios)} rounds; "
          f"quartiles {100 * (q[0] - 1):+.2f}% .. {100 * (q[2] - 1):+.2f}%)")


if __name__ == "__main__":
    main()
