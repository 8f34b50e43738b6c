"""Data-parallel scaling on this machine, and gpudl's DDP against a raw DistributedDataParallel loop.

Part 1 (--part scaling): `gpudl train` with 1 and with 2 processes (one thread each, the same
batch per process), alternating in rounds; samples/s from each run's summary (its steady
state: the first log window, with start-up, is left out). Prints the speed-up 2 vs 1.

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


def gpudl_run(nproc: int, out: Path, name: str) -> float:
    """samples/s of one `gpudl train` with `nproc` single-thread processes."""
    sets = [a for s in [*TINY, f"run.dir={out}", f"run.name={name}"] for a in ("--set", s)]
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "gpudl", "train", *launch, *sets], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((out / name / "summary.json").read_text())["samples_per_s"]


def part_scaling(rounds: int) -> None:
    out = Path(tempfile.mkdtemp(prefix="gpudl-scaling-"))
    speedups = []
    for r in range(rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        rates = {n: gpudl_run(n, out, f"r{r}-n{n}") for n in order}
        speedups.append(rates[2] / rates[1])
        print(f"round {r + 1}: 1 process {rates[1]:7.1f} samples/s · 2 processes {rates[2]:7.1f} samples/s · "
              f"speed-up {speedups[-1]:.2f}x")
    print(f"scaling 1 -> 2 processes: {statistics.median(speedups):.2f}x (median of {rounds} rounds; "
          f"goal >= 1.8x)")


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
