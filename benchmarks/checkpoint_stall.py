"""How long a checkpoint save blocks the training loop, with checkpoint.async off and on.

Each round trains the same recipe twice in this process, once with blocking saves and once with
background saves (the order alternates each round), `--steps` steps with a save every `--every`.
What is timed is the loop's own view: the time `Monitor.after_step` takes at a step that saves
(for background saves: waiting for the previous write, then the copy into the host buffers), the
wait for the last write at the end of the run, and the run's whole loop (`wall_s`), which also
carries what the background write costs the steps it runs beside. The figures are medians over
rounds and the ratios async / blocking: of the medians, and the median of each round's own ratio
(a round's two runs share the machine's load of the moment).

    python benchmarks/checkpoint_stall.py                      # gpt2-124m on the CPU, 2 rounds
    python benchmarks/checkpoint_stall.py --config gpt-1b --device cuda --set train.batch_size=4
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from gpudl.checkpoint.background import BackgroundWriter
from gpudl.config import load_config
from gpudl.run.monitor import Monitor
from gpudl.run.recipe import train


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt2-124m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=12)
    # a save every 4 steps: on 2 CPU cores a write of gpt2-124m ends before the next save, as in a real run
    # (a save every 200 steps); closer saves also wait for the write before them (one save in flight)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", action="append", default=[], dest="sets", help="more --set section.key=value")
    return p.parse_args()


class Clock:
    """Times the saving steps' `after_step` and the end-of-run wait, by patching the two methods (once)."""

    def __init__(self):
        self.reset()
        after_step, close = Monitor.after_step, BackgroundWriter.close

        def timed_after_step(monitor, state):
            due = monitor.saver is not None and monitor.saver.due(state.step, monitor.train.max_steps)
            t0 = time.perf_counter()
            after_step(monitor, state)
            if due and state.step < monitor.train.max_steps:  # the last save is waited for at the end
                self.saves.append(time.perf_counter() - t0)

        def timed_close(writer, raise_error=True):
            t0 = time.perf_counter()
            close(writer, raise_error)
            self.end_wait += time.perf_counter() - t0

        Monitor.after_step, BackgroundWriter.close = timed_after_step, timed_close

    def reset(self) -> None:
        self.saves: list[float] = []
        self.end_wait = 0.0


def one_run(args, root: Path, mode: bool, clock: Clock) -> dict:
    clock.reset()
    sets = [f"run.dir={root}", f"run.name={'async' if mode else 'sync'}", f"run.device={args.device}",
            f"train.max_steps={args.steps}", f"checkpoint.every={args.every}", f"checkpoint.async={str(mode).lower()}",
            "train.batch_size=1", "train.grad_accum=1", "model.block_size=128", "train.eval_every=0",
            "train.time_budget_s=0", "checkpoint.export=false", "sample.tokens=0", "log.progress=false",
            "log.plot=false", "log.tensorboard=false", *args.sets]
    result = train(load_config(args.config, sets), console=Console(quiet=True))
    shutil.rmtree(result.run_dir)
    return {"stall_s": statistics.median(clock.saves), "end_wait_s": clock.end_wait,
            "wall_s": result.summary["wall_s"], "params_m": result.summary["params_m"]}


def main() -> None:
    args = parse()
    runs, clock = {False: [], True: []}, Clock()
    with tempfile.TemporaryDirectory(prefix="gpudl-stall-") as tmp:
        for r in range(args.rounds):
            for mode in ((False, True) if r % 2 == 0 else (True, False)):
                runs[mode].append(one_run(args, Path(tmp), mode, clock))
                print(f"round {r + 1} {'async' if mode else 'sync '}: {runs[mode][-1]}", flush=True)
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in ("stall_s", "end_wait_s", "wall_s")}
           for m in runs}
    # a round's two runs share the machine's load of the moment: their ratio is the steadier figure
    pair = {k: statistics.median(a[k] / s[k] for s, a in zip(runs[False], runs[True])) for k in ("stall_s", "wall_s")}
    print(f"\n{args.config} ({runs[False][0]['params_m']:.1f}M parameters) on {args.device}, "
          f"torch {torch.__version__}, "
          f"{args.steps} steps, a save every {args.every}, {args.rounds} rounds (medians)")
    for key in ("stall_s", "end_wait_s", "wall_s"):
        sync, asyn = med[False][key], med[True][key]
        ratio = f"ratio of medians {asyn / sync:.3f}, median of the rounds' ratios {pair[key]:.3f}" if sync else ""
        print(f"  {key:<11} blocking {sync:8.3f} s   background {asyn:8.3f} s   {ratio}")


if __name__ == "__main__":
    main()
