"""gpudl against a minimal raw PyTorch loop, Lightning Fabric and Hugging Face Accelerate, interleaved.

Same model (gpt-tiny by default; any preset with --model), same synthetic data, interleaved rounds:
every round runs each tool for a few steps, in an order that rotates from round to round, so that
whatever else the machine does falls on all of them alike. Only medians over many rounds mean
anything on a shared machine. Two comparisons, each in a process of its own:

1. Identical settings: every tool drives the very same model, optimizer and scheduler objects over
   the same batches, already on the device, at the precision gpudl picks for the device (separate
   copies differ by a few percent on their own: memory placement). Per tool: its time over raw
   PyTorch's in the same round. gpudl's goal: at most 1% slower than raw PyTorch.
2. Each tool's defaults: each tool runs in a process of its own (so that process-wide settings,
   such as gpudl's allocator tuning on the CPU or Accelerate's state, stay with the tool that made
   them), builds its own model (same seed) and optimizer, and reads the same tensors through its
   own data path, the way its documentation starts a user off: raw PyTorch and the others in fp32
   with `torch.optim.AdamW` and a `DataLoader`; gpudl as `gpudl.fit` sets itself up (automatic
   precision and compile, fused AdamW, prefetching loader, clipping, metrics, host allocator). The
   processes take turns, one at a time, as the rounds rotate. Per tool: samples/s, and gpudl's
   over each other tool's in the same round. gpudl's goal: 1.5x.

Fabric and Accelerate are measured when installed (`pip install lightning accelerate`, not
dependencies of gpudl) and reported as skipped otherwise.

    python benchmarks/peers.py
    python benchmarks/peers.py --rounds 40 --steps 5 --only identical
    python benchmarks/peers.py --model resnet18 --rounds 15
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from gpudl import models
from gpudl.config import Config, OptimConfig, TrainConfig
from gpudl.data import DeviceLoader
from gpudl.data.datasets import as_batch_source
from gpudl.device import detect, synchronize
from gpudl.device.host import keep_freed_memory
from gpudl.training.kernels import attention_kernel
from gpudl.distributed.parallelize import compile_wanted
from gpudl.models.attention import use_attention
from gpudl.observe.metrics import Throughput
from gpudl.observe.sinks import FileSink
from gpudl.training.job import Task, build_job
from gpudl.training.loop import Job, TrainState, train_loop
from gpudl.run.monitor import Monitor
from gpudl.training.optim import make_optimizer, make_scheduler
from gpudl.training.precision import make_precision
from gpudl.distributed.session import Session

LR = 3e-3
FABRIC_PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed", "bf16-true": "bf16-true"}
PEERS = (("Lightning Fabric", "lightning"), ("HF Accelerate", "accelerate"))  # (name, module)
ACCELERATE_PRECISION = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=5, help="steps per tool per round")
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not counted (compile, caches)")
    p.add_argument("--only", choices=["identical", "defaults"],
                   help="run one of the two comparisons (without it: both, each in a process of its own)")
    return p.parse_args()


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def gpudl_steps(job: Job, batches: Callable[[], object], steps: int, batch_size: int) -> Callable[[], None]:
    """gpudl's loop as a run drives it: train_loop with the metrics monitor writing JSONL/CSV."""
    total = 10**9
    info = detect(str(next(job.model.parameters()).device))
    monitor = Monitor(session=Session(info), train=TrainConfig(max_steps=total, eval_every=0),
                      throughput=Throughput(batch_size, 1, 1.0, 1.0),
                      sinks=[FileSink(Path(tempfile.mkdtemp(prefix="gpudl-peers-")))])
    state, cfg = TrainState(), TrainConfig(max_steps=total, eval_every=0)

    def run():
        job.batches = batches()
        cfg.max_steps = state.step + steps
        train_loop(job, cfg, state, monitor)
    return run


# --- 1. identical settings: one model, optimizer, scheduler and batch list, driven by each tool ---------

def identical_tools(model, loss_fn, opt, sched, prec, batches: list, device: torch.device, steps: int,
                    batch: int) -> dict:
    tools = {}

    scaler = torch.amp.GradScaler(device.type) if prec.name == "fp16-mixed" else None

    def raw():  # the loop a person writes by hand
        for b in batches:
            with torch.autocast(device.type, dtype=prec.autocast_dtype, enabled=prec.autocast_dtype is not None):
                loss = loss_fn(model, b)
            if scaler is None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
    tools["raw PyTorch"] = raw
    job = Job(model=model, loss_fn=loss_fn, optimizer=opt, scheduler=sched, precision=prec, batches=iter(()))
    tools["gpudl"] = gpudl_steps(job, lambda: iter(batches), steps, batch)
    if installed("lightning") and prec.name in FABRIC_PRECISION:
        tools["Lightning Fabric"] = _fabric_identical(model, loss_fn, opt, sched, prec, batches, device)
    if installed("accelerate") and prec.name in ACCELERATE_PRECISION:
        tools["HF Accelerate"] = _accelerate_identical(model, loss_fn, opt, sched, prec, batches, device)
    return tools


def _fabric_identical(model, loss_fn, opt, sched, prec, batches, device):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator=device.type, devices=1, precision=FABRIC_PRECISION[prec.name])
    fmodel, fopt = fabric.setup(model, opt, move_to_device=False)  # wrappers around the same objects

    def run():
        for b in batches:
            fabric.backward(loss_fn(fmodel, b))
            fabric.clip_gradients(fmodel, fopt, max_norm=1.0)
            fopt.step()
            fopt.zero_grad(set_to_none=True)
            sched.step()
    return run


def _accelerate_identical(model, loss_fn, opt, sched, prec, batches, device):
    from accelerate import Accelerator

    acc = Accelerator(cpu=device.type == "cpu", mixed_precision=ACCELERATE_PRECISION[prec.name])
    amodel, aopt, asched = acc.prepare(model, opt, sched)
    # prepare() puts an autocast forward on the model instance itself: keep it to Accelerate's rounds.
    accelerate_forward = model.__dict__.pop("forward", None)

    def run():
        if accelerate_forward is not None:
            model.forward = accelerate_forward
        try:
            for b in batches:
                acc.backward(loss_fn(amodel, b))
                acc.clip_grad_norm_(amodel.parameters(), 1.0)
                aopt.step()
                asched.step()
                aopt.zero_grad(set_to_none=True)
        finally:
            model.__dict__.pop("forward", None)
    return run


# --- 2. each tool's defaults: its own model, optimizer and data path, as its documentation starts you off --

def _epochs(loader):
    while True:
        yield from loader


def defaults_tools(spec_name: str, device: str, steps: int, batch: int) -> dict:
    """One worker process per installed tool, each waiting for its turn; see `_defaults_worker`."""
    names = ["raw PyTorch", "gpudl"] + [name for name, module in PEERS if installed(module)]
    ctx = mp.get_context("spawn")
    tools = {}
    for name in names:
        ours, theirs = ctx.Pipe()
        ctx.Process(target=_defaults_worker, args=(name, spec_name, device, steps, batch, theirs),
                    daemon=True).start()
        print(ours.recv())  # the worker's line on its set-up: it is ready
        tools[name] = _remote(ours)
    return tools


def _remote(conn) -> Callable[[], float]:
    def run() -> float:
        conn.send("go")
        return conn.recv()
    return run


def _defaults_worker(name: str, spec_name: str, device: str, steps: int, batch: int, conn) -> None:
    """Build `name`'s set-up in this process, then run `steps` steps per "go" and send back the seconds."""
    dev = detect(device).torch_device
    spec = models.resolve(spec_name)
    data = synthetic_data(spec, batch * 64)
    if name == "gpudl":
        run, setup = _gpudl_defaults(spec, data, dev, steps, batch)
    else:  # fp32, default AdamW and a DataLoader: what each of the others starts from
        model = models.build(spec, dev, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = DataLoader(TensorDataset(*data), batch_size=batch, shuffle=True, drop_last=True)
        make = {"raw PyTorch": _raw_defaults, "Lightning Fabric": _fabric_defaults,
                "HF Accelerate": _accelerate_defaults}[name]
        run, setup = make(model, opt, models.loss_for(spec), loader, dev, steps)
    conn.send(f"{name} defaults: {setup}")
    try:
        while conn.recv() == "go":
            conn.send(timed(run, dev))
    except EOFError:  # the coordinator is done
        pass


def _raw_defaults(model, opt, loss_fn, loader, device, steps):
    it = _epochs(loader)

    def run():
        for _ in range(steps):
            loss_fn(model, [t.to(device) for t in next(it)]).backward()
            opt.step()
            opt.zero_grad()
    return run, "fp32, torch.optim.AdamW, DataLoader"


def _gpudl_defaults(spec, data, device: torch.device, steps: int, batch: int):
    """Set up as `gpudl.fit` sets itself up, with every setting left at its default."""
    info = detect(str(device))
    if info.type == "cpu":
        keep_freed_memory()  # what a gpudl run does on the CPU (run.keep_host_memory)
    prec = make_precision("auto", info)
    model = models.build(spec, device, prec.param_dtype, seed=0)
    cfg = Config(optim=OptimConfig(lr=LR, warmup_steps=0), train=TrainConfig(max_steps=10**9))
    job = build_job(model, cfg, Session(info), prec, Task(models.loss_for(spec)))
    loader = DeviceLoader(as_batch_source(data, batch, seed=0), device)
    setup = (f"precision {prec.name} ({prec.reason}); compile "
             f"{'on' if compile_wanted('auto', device.type) else 'off'}; "
             f"AdamW fused={job.optimizer.defaults.get('fused')}")
    return gpudl_steps(job, lambda: loader, steps, batch), setup


def _fabric_defaults(model, opt, loss_fn, loader, device, steps):
    from lightning.fabric import Fabric

    fabric = Fabric()
    fmodel, fopt = fabric.setup(model, opt)
    it = _epochs(fabric.setup_dataloaders(loader))

    def run():
        for _ in range(steps):
            fabric.backward(loss_fn(fmodel, next(it)))
            fopt.step()
            fopt.zero_grad()
    return run, f"precision {fabric._precision.precision!r}"


def _accelerate_defaults(model, opt, loss_fn, loader, device, steps):
    from accelerate import Accelerator

    acc = Accelerator()
    amodel, aopt, aloader = acc.prepare(model, opt, loader)
    it = _epochs(aloader)

    def run():
        for _ in range(steps):
            acc.backward(loss_fn(amodel, next(it)))
            aopt.step()
            aopt.zero_grad()
    return run, f"mixed precision {acc.mixed_precision!r}"


# --- rounds -----------------------------------------------------------------------------------------

def timed(run: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - t0


def rounds(tools: dict[str, Callable[[], float]], n: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per round for each tool (each call returns its own); the order rotates every round."""
    names = list(tools)
    times = {name: [] for name in names}
    for r in range(warmup + n):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            seconds = tools[name]()
            if r >= warmup:
                times[name].append(seconds)
    return times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def report(title: str, times: dict[str, list[float]], samples: int, versus: str) -> None:
    """Per tool: median samples/s; the per-round ratio against `versus` (median and quartiles)."""
    print(f"\n{title}")
    for name, ts in times.items():
        rate = statistics.median(samples / t for t in ts)
        line = f"  {name:<18} {rate:9.1f} samples/s (median of {len(ts)} rounds)"
        if name != versus:
            lo, mid, hi = quartiles([t / v for t, v in zip(ts, times[versus])])
            line += (f" · time vs {versus}: {100 * (mid - 1):+.2f}% "
                     f"(quartiles {100 * (lo - 1):+.2f}% .. {100 * (hi - 1):+.2f}%)")
        print(line)


def report_gpudl_over(times: dict[str, list[float]]) -> None:
    print("  gpudl's samples/s over each tool's, per round:")
    for name, ts in times.items():
        if name != "gpudl":
            lo, mid, hi = quartiles([t / g for t, g in zip(ts, times["gpudl"])])
            print(f"    over {name:<18} {mid:.2f}x (quartiles {lo:.2f}x .. {hi:.2f}x)")


def synthetic_data(spec: models.ModelSpec, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` random samples of the model's input: token windows (next-token targets) or 32x32 images."""
    g, c = torch.Generator().manual_seed(0), spec.config
    if spec.is_language_model:
        tokens = torch.randint(0, c.vocab_size, (n, c.block_size + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(n, c.in_channels, 32, 32, generator=g), torch.randint(0, c.num_classes, (n,), generator=g)


def main() -> None:
    args = parse()
    if args.only is None:
        # One process per comparison: Accelerate keeps its precision in process-wide state, so an
        # Accelerator made for the identical settings would set the precision of its "defaults" too.
        for part in ("identical", "defaults"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", part], check=True)
        return
    info = detect(args.device)
    skipped = [name for name, module in PEERS if not installed(module)]
    print(f"Using device: {info.label} · {args.model} · batch {args.batch_size} · {args.rounds} rounds x "
          f"{args.steps} steps per tool · torch {torch.__version__}"
          + (f" · skipped (not installed): {', '.join(skipped)}" if skipped else ""))
    samples = args.batch_size * args.steps
    if args.only == "identical":
        times, prec = compare_identical(args, info)
        report(f"1. identical settings ({prec}, same model/optimizer/batches on the device)", times, samples,
               "raw PyTorch")
    else:
        tools = defaults_tools(args.model, args.device, args.steps, args.batch_size)
        times = rounds(tools, args.rounds, args.warmup_rounds)
        report("2. each tool's defaults (own process, model, optimizer and data path)", times, samples,
               "raw PyTorch")
        report_gpudl_over(times)


def compare_identical(args: argparse.Namespace, info) -> tuple[dict[str, list[float]], str]:
    dev = info.torch_device
    if info.type == "cpu":
        keep_freed_memory()  # what a gpudl run does on the CPU; every tool shares this process and gets it
    spec = models.resolve(args.model)
    data = synthetic_data(spec, args.batch_size * args.steps)
    prec = make_precision("auto", info)
    model = models.build(spec, dev, prec.param_dtype, seed=0)
    use_attention(model, attention_kernel(info))  # the model as gpudl runs it, for every tool alike
    opt = make_optimizer(model, OptimConfig(lr=LR), dev.type)
    sched = make_scheduler(opt, OptimConfig(lr=LR), 10**9)
    batches = [tuple(t[i * args.batch_size:(i + 1) * args.batch_size].to(dev) for t in data)
               for i in range(args.steps)]
    tools = identical_tools(model, models.loss_for(spec), opt, sched, prec, batches, dev, args.steps,
                            args.batch_size)
    timed_tools = {name: (lambda run=run: timed(run, dev)) for name, run in tools.items()}
    return rounds(timed_tools, args.rounds, args.warmup_rounds), prec.name


if __name__ == "__main__":
    main()
