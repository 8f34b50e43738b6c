"""What gpudl's loop does per step beyond a raw PyTorch loop: operators, allocations, host reads, Python calls.

Counts, not times, so the answer is the same on a busy machine and a quiet one, and on the CPU
what a GPU would see: each aten operator is a kernel launch there, each host read a sync. The
loops are those of `benchmarks/overhead.py` (the same model, optimizer, schedule and batches;
gpudl's `train_loop` with no events, then with the run's monitor and its files), each run for
`--steps` steps after a warm-up, inside

- a TorchDispatchMode that counts aten operators and the outputs that got storage of their own
  (allocations, as the caching allocator would be asked for them),
- a TorchFunctionMode that counts host reads of tensor values (`.item()`, `bool()`, `.tolist()`, ...),
- `sys.setprofile`, which counts Python function calls and calls into C (on a run of its own).

    python benchmarks/loop_profile.py                       # gpt-tiny, fp32, on the CPU
    python benchmarks/loop_profile.py --device-guard        # what a GPU run adds: the guard on the device
    python benchmarks/loop_profile.py --model linear --precision fp32
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).parent))
from overhead import Linear, _model_job, raw_steps  # noqa: E402  (the same loops overhead.py times)

from gpudl.config import Config, TrainConfig  # noqa: E402
from gpudl.device import detect  # noqa: E402
from gpudl.observe.metrics import Throughput  # noqa: E402
from gpudl.observe.sinks import FileSink  # noqa: E402
from gpudl.training.finite import DeviceGuard  # noqa: E402
from gpudl.training.job import Task, build_job  # noqa: E402
from gpudl.training.loop import NoEvents, TrainState, train_loop  # noqa: E402
from gpudl.run.monitor import Monitor  # noqa: E402
from gpudl.training.precision import make_precision  # noqa: E402
from gpudl.distributed.session import Session  # noqa: E402

HOST_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy}


class Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.allocations = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func.overloadpacket)] += 1
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.allocations += sum(1 for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel()
                                and t.untyped_storage().data_ptr() not in inputs)
        return out


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def counted(fn, steps: int) -> dict:
    """Per-step counts of `fn` (which runs `steps` steps): operators and reads in one call, Python calls in
    another."""
    calls = Counter()

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            calls[event] += 1

    ops, reads = Operators(), HostReads()
    with reads, ops:
        fn()
    sys.setprofile(profile)  # on a run of its own: the modes above are Python calls too
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {"aten operators": sum(ops.ops.values()) / steps, "allocations": ops.allocations / steps,
            "host reads": sum(reads.reads.values()) / steps, "Python calls": calls["call"] / steps,
            "calls into C": calls["c_call"] / steps, "_ops": ops.ops, "_reads": reads.reads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--steps", type=int, default=20, help="counted steps per loop (log_every is 10)")
    p.add_argument("--device-guard", action="store_true",
                   help="the non-finite guard an accelerator gets (decided on the device), as a GPU run does")
    args = p.parse_args()
    info = detect("cpu")
    prec = make_precision(args.precision, info)
    dev = info.torch_device
    model, batches, loss_fn, units = Linear.job(dev, args.steps) if args.model == "linear" else \
        _model_job(argparse.Namespace(model=args.model, batch_size=args.batch_size, steps=args.steps), dev, prec)
    train_cfg = TrainConfig(max_steps=10**6, batch_size=len(batches[0][0]), log_every=10)
    session = Session(info)
    job = build_job(model, Config(train=train_cfg), session, prec, Task(loss_fn))
    if args.device_guard:
        job.guard = DeviceGuard()
    monitor = Monitor(session=session, train=train_cfg, sinks=[FileSink(Path(tempfile.mkdtemp(prefix="gpudl-prof-")))],
                      throughput=Throughput(train_cfg.batch_size, units, 1.0, 1.0))
    state = TrainState()

    def ours(events):
        def run():
            job.batches = iter(batches)
            train_loop(job, dataclasses.replace(train_cfg, max_steps=state.step + args.steps), state, events)
        return run

    loops = {"raw PyTorch": lambda: raw_steps(job.model, job.optimizer, job.scheduler, batches, prec.autocast,
                                              loss_fn, train_cfg.grad_clip),
             "gpudl, no events": ours(NoEvents()), "gpudl, with its monitor": ours(monitor)}
    for fn in loops.values():
        fn()  # warm-up: lazy state (the optimizer's moments, the guard's) is made in the first steps
    results = {name: counted(fn, args.steps) for name, fn in loops.items()}
    print(f"{args.model} · {prec.name} · batch {train_cfg.batch_size} · {type(job.guard).__name__} · per step, mean "
          f"of {args.steps} steps (metrics logged every 10)")
    keys = [k for k in results["raw PyTorch"] if not k.startswith("_")]
    print(f"{'':26}" + "".join(f"{k:>16}" for k in keys))
    for name, r in results.items():
        print(f"{name:26}" + "".join(f"{r[k]:>16.1f}" for k in keys))
    raw, ours_ = results["raw PyTorch"]["_ops"], results["gpudl, with its monitor"]["_ops"]
    extra = {op: (ours_[op] - raw.get(op, 0)) / args.steps for op in ours_ if ours_[op] != raw.get(op, 0)}
    print("operators gpudl adds per step: " + (", ".join(f"{op} {n:+.1f}" for op, n in
                                                        sorted(extra.items(), key=lambda kv: -abs(kv[1]))) or "none"))
    print("host reads with the monitor: " + (", ".join(f"{k} {v / args.steps:.1f}" for k, v in
                                                     results["gpudl, with its monitor"]["_reads"].items()) or "none"))


if __name__ == "__main__":
    main()
