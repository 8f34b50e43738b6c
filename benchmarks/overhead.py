"""gpudl's training loop vs a minimal raw PyTorch loop: same model, batches, optimizer, precision.

Both loops run in this one process, interleaved in short rounds (the order alternates each
round), and both drive the very same model, optimizer and scheduler objects over the same
batches already on the device: separate copies differ by a few percent in speed on their own
(memory placement), which would drown a 1% question. The gpudl side is the real thing:
`train_loop` with its finiteness guard and the run's metrics monitor (throughput, MFU,
memory, JSONL/CSV files). The figure is the median over rounds of (gpudl time / raw time) - 1.

Each round times the two loops `--repeats` times, alternating, and its ratio is the median of
the ratios of the timings taken side by side: on a shared machine the speed drifts by tens of
percent over seconds, so only timings a step apart compare, and the median leaves out a
neighbour's burst that lands on one side. The median's 95% interval (bootstrap over rounds)
says how well the run resolves the overhead.

`--model linear` times the loop's own machinery: an 8 -> 2 linear layer on batches of 4, where
the loop is nearly all there is, so the difference is what gpudl adds per step in microseconds.
Divided by a model's step time, that bounds its overhead where rounds cannot resolve it.

    python benchmarks/overhead.py                      # gpt-tiny, auto device and precision
    python benchmarks/overhead.py --model linear --steps 400 --rounds 20
    python benchmarks/overhead.py --model resnet18 --batch-size 32 --rounds 20
"""

from __future__ import annotations

import argparse
import dataclasses
import random
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
from gpudl.run.monitor import Monitor
from gpudl.training.precision import make_precision
from gpudl.distributed.session import Session


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--steps", type=int, default=2, help="steps per timing")
    p.add_argument("--repeats", type=int, default=9, help="timings of each loop per round, alternating")
    return p.parse_args()


class Linear:
    """`--model linear`: the smallest job, so that the loop's own per-step work is what is timed."""

    name = "linear"

    @staticmethod
    def job(dev, steps: int):
        model = torch.nn.Linear(8, 2).to(dev)
        x, y = torch.randn(4, 8, device=dev), torch.randint(0, 2, (4,), device=dev)
        loss_fn = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1])  # noqa: E731
        return model, [(x, y)] * steps, loss_fn, 1


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
    prec = make_precision("fp32" if args.model == "linear" else args.precision, info)
    dev = info.torch_device
    model, batches, loss_fn, units = Linear.job(dev, args.steps) if args.model == "linear" else \
        _model_job(args, dev, prec)
    total = 2 * (args.rounds + 1) * args.repeats * args.steps
    train_cfg = TrainConfig(max_steps=total, batch_size=len(batches[0][0]))
    session = Session(info)
    # gpudl's own assembly (attention kernel, optimizer, schedule); the raw loop steps the same objects
    job = build_job(model, Config(train=train_cfg), session, prec, Task(loss_fn))
    model, opt, sched = job.model, job.optimizer, job.scheduler
    run_dir = Path(tempfile.mkdtemp(prefix="gpudl-overhead-"))
    monitor = Monitor(session=session, train=train_cfg, sinks=[FileSink(run_dir)],
                      throughput=Throughput(train_cfg.batch_size, units, 1.0, 1.0))
    state = TrainState()
    print(f"Using device: {info.label} · precision {prec.name} · {args.model} · batch {train_cfg.batch_size} · "
          f"{args.rounds} rounds x {args.repeats} repeats x {args.steps} steps")

    def run_ours():
        job.batches = iter(batches)
        train_loop(job, dataclasses.replace(train_cfg, max_steps=state.step + args.steps), state, monitor)

    def run_theirs():
        raw_steps(model, opt, sched, batches, prec.autocast, loss_fn, train_cfg.grad_clip)

    ratios, ours_s, raw_s = [], [], []
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        pair = (run_ours, run_theirs) if r % 2 else (run_theirs, run_ours)
        t = {fn: [] for fn in pair}
        for _ in range(args.repeats):
            for fn in pair:
                t[fn].append(timed(fn, dev))
        ours, theirs = min(t[run_ours]) / args.steps, min(t[run_theirs]) / args.steps
        if r:
            ratios.append(statistics.median(a / b for a, b in zip(t[run_ours], t[run_theirs])))
            ours_s.append(ours)
            raw_s.append(theirs)
            print(f"round {r:>2}: gpudl {1e3 * ours:8.3f} ms/step · raw {1e3 * theirs:8.3f} ms/step · "
                  f"ratio {ratios[-1]:.4f}")
    report(ratios, ours_s, raw_s)


def _model_job(args, dev, prec):
    spec = models.resolve(args.model)
    data = build_data(DataConfig(kind="synthetic"), spec, args.batch_size, seed=0)
    batches = [tuple(t.to(dev) for t in data.train.batch(k)) for k in range(args.steps)]
    return models.build(spec, dev, prec.param_dtype, seed=0), batches, models.loss_for(spec), data.units_per_sample


def median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of `values` (resampled with a fixed seed)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def report(ratios: list[float], ours_s: list[float], raw_s: list[float]) -> None:
    q = statistics.quantiles(ratios, n=4)
    lo, hi = median_interval(ratios)
    added_us = 1e6 * (statistics.median(ours_s) - statistics.median(raw_s))
    print(f"overhead: {100 * (statistics.median(ratios) - 1):+.2f}% (median of {len(ratios)} rounds; "
          f"quartiles {100 * (q[0] - 1):+.2f}% .. {100 * (q[2] - 1):+.2f}%; the median's 95% interval "
          f"{100 * (lo - 1):+.2f}% .. {100 * (hi - 1):+.2f}%)")
    print(f"per step: gpudl {1e3 * statistics.median(ours_s):.3f} ms, raw {1e3 * statistics.median(raw_s):.3f} ms: "
          f"{added_us:+.1f} us a step")


if __name__ == "__main__":
    main()
