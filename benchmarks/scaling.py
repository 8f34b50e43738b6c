"""Data-parallel scaling on this machine, and gpudl's DDP against a raw DistributedDataParallel loop.

Part 1 (--part scaling): `gpudl train` with 1 and with 2 processes (one thread each, the same
batch per process), and two independent single-process runs at once (what the machine allows
two processes when they need not talk), in rounds that alternate the order; samples/s from each
run's summary (its steady state: the first log window, with start-up, is left out). Prints
the speed-up 2 vs 1, and the independent runs' for scale.

Part 2 (--part ddp): one 2-process job; in every process gpudl's loop and a plain DDP loop
drive the same DDP-wrapped model, optimizer and batches in alternating rounds (as
benchmarks/overhead.py does in one process); prints the median time ratio.

    python benchmarks/scaling.py                 # both parts
    python benchmarks/scaling.py --part ddp --rounds 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TINY = ["train.max_steps=40", "train.log_every=10", "train.eval_every=0", "checkpoint.every=0",
        "checkpoint.export=false", "sample.tokens=0", "log.plot=false", "log.progress=false", "train.batch_size=16"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["scaling", "ddp", "both"], default="both")
    p.add_argument("--rounds", type=int, default=3, help="rounds of part 1; part 2 uses 10x as many")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def gpudl_runs(nproc: int, independent: int, out: Path, name: str) -> float:
    """samples/s of `gpudl train` with `nproc` single-thread processes; summed over `independent` such
    jobs run at once (two single-process jobs side by side: this machine's ceiling for two processes,
    with nothing to communicate)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    names = [f"{name}-{i}" for i in range(independent)]

    def command(run_name: str) -> list[str]:
        sets = [a for s in [*TINY, f"run.dir={out}", f"run.name={run_name}"] for a in ("--set", s)]
        return [sys.executable, "-m", "gpudl", "train", *launch, *sets]

    jobs = [subprocess.Popen(command(n), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for n in names]
    if any(job.wait() for job in jobs):
        raise SystemExit(f"a gpudl train run of round {name} failed; run it by hand to see why")
    return sum(json.loads((out / n / "summary.json").read_text())["samples_per_s"] for n in names)


def part_scaling(rounds: int) -> None:
    out = Path(tempfile.mkdtemp(prefix="gpudl-scaling-"))
    runs = {"1 process": (1, 1), "2 processes (DDP)": (2, 1), "2 independent processes": (1, 2)}
    speedups, ceilings = [], []
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        rates = {what: gpudl_runs(*runs[what], out, f"r{r}-{i}") for i, what in enumerate(order)}
        speedups.append(rates["2 processes (DDP)"] / rates["1 process"])
        ceilings.append(rates["2 independent processes"] / rates["1 process"])
        print(f"round {r + 1}: " + " · ".join(f"{what} {rates[what]:.1f}" for what in runs) +
              f" samples/s · speed-up {speedups[-1]:.2f}x (independent: {ceilings[-1]:.2f}x)")
    print(f"scaling 1 -> 2 processes: {statistics.median(speedups):.2f}x (median of {rounds} rounds; goal >= 1.8x); "
          f"two independent processes, with nothing to communicate: {statistics.median(ceilings):.2f}x")


def part_ddp(rounds: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--part", "ddp", "--worker", "--rounds", str(rounds)]
    subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)


def main() -> None:
    args = parse()
    if args.worker:
        sys.path.insert(0, str(HERE))
        from scaling_worker import ddp_worker

        ddp_worker(args.rounds * 10)
        return
    if args.part in ("scaling", "both"):
        part_scaling(args.rounds)
    if args.part in ("ddp", "both"):
        part_ddp(args.rounds)


if __name__ == "__main__":
    main()
