"""What the CPU memory limit (gpudl.memory.limit.LiveBytesLimit) costs a training step.

The same job (gpudl's `build_job`: model, fused AdamW, schedule) takes `train_loop` steps with
and without the limit active, in one process, interleaved in short rounds whose order alternates,
over the same batches already in memory. The limit is far above the step's peak, so it only
counts: every operator's outputs are looked at, and each new storage gets a weak reference. The
figure is the median over rounds of (time with the limit / time without) - 1, by the wall clock
and by this process's CPU time (steadier where other processes share the cores).

    python benchmarks/memory_limit_overhead.py                      # gpt-tiny, batch 8, fp32
    python benchmarks/memory_limit_overhead.py --batch-size 32 --rounds 30 --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from gpudl import models
from gpudl.config import Config, DataConfig, TrainConfig
from gpudl.data import build_data
from gpudl.device import cpu_info
from gpudl.device.host import keep_freed_memory
from gpudl.memory.limit import limit_memory
from gpudl.training.job import Task, build_job
from gpudl.training.loop import NoEvents, TrainState, train_loop
from gpudl.training.precision import make_precision
from gpudl.distributed.session import Session


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=4, help="steps per side per round")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    return p.parse_args()


def cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="utf8") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # what a gpudl run does on the CPU; both sides share this process and get it
    info = cpu_info()
    prec = make_precision("fp32", info)
    spec = models.resolve(args.model)
    data = build_data(DataConfig(kind="synthetic"), spec, args.batch_size, seed=0)
    batches = [data.train.batch(k) for k in range(args.steps)]
    train_cfg = TrainConfig(max_steps=2 * (args.rounds + 1) * args.steps, batch_size=args.batch_size)
    job = build_job(models.build(spec, info.torch_device, prec.param_dtype, seed=0), Config(train=train_cfg),
                    Session(info), prec, Task(models.loss_for(spec)))
    state = TrainState()
    peaks = []

    def plain():
        job.batches = iter(batches)
        train_loop(job, dataclasses.replace(train_cfg, max_steps=state.step + args.steps), state, NoEvents())

    def limited():
        with limit_memory(info, 2**40, hold=(job.model, job.optimizer, batches)) as limit:
            plain()
        peaks.append(limit.peak_bytes)

    print(f"{time.strftime('%Y-%m-%d')} · {cpu_model()} · ISA {torch.backends.cpu.get_cpu_capability()} · "
          f"{torch.get_num_threads()} threads · torch {torch.__version__} · {args.model} batch {args.batch_size} "
          f"fp32 · {args.rounds} rounds x {args.steps} steps")
    ratios = {"wall": [], "cpu": []}
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        pair = (limited, plain) if r % 2 else (plain, limited)
        t, c = {}, {}
        for fn in pair:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            t[fn], c[fn] = time.perf_counter() - t0, time.process_time() - c0
        if r:
            ratios["wall"].append(t[limited] / t[plain])
            ratios["cpu"].append(c[limited] / c[plain])
            print(f"round {r:>2}: limited {1e3 * t[limited] / args.steps:8.2f} ms/step · plain "
                  f"{1e3 * t[plain] / args.steps:8.2f} ms/step · ratio {ratios['wall'][-1]:.4f} "
                  f"(CPU time {ratios['cpu'][-1]:.4f})")
    print(f"counted peak {peaks[-1] / 2**20:.2f} MiB (model, optimizer state, batches and the step's tensors)")
    for clock, rs in ratios.items():
        q = statistics.quantiles(rs, n=4)
        print(f"overhead of the CPU memory limit ({clock}): {100 * (statistics.median(rs) - 1):+.2f}% per step "
              f"(median of {len(rs)} rounds; quartiles {100 * (q[0] - 1):+.2f}% .. {100 * (q[2] - 1):+.2f}%)")


if __name__ == "__main__":
    main()
