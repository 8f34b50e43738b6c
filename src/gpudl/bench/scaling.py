"""`gpudl bench --scaling`: the same training job on 1, 2, 4 ... N processes of this machine.

Each point is a real `gpudl train` (through the launcher for more than one process) on
synthetic data, with the same batch per process, so ideal scaling is N times the samples/s of
one process. On the CPU the cores are split evenly between the processes (OMP_NUM_THREADS),
so every point uses the whole machine. The sequence runs `repeats` times, in alternating
order, and each point keeps its median: the machine may be shared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from rich.console import Console

from ..device import detect
from ..errors import UserError
from .runner import machine

STUDY_SETS = ["data.kind=synthetic", "train.log_every=5", "train.eval_every=0", "checkpoint.every=0",
              "checkpoint.export=false", "sample.tokens=0", "log.plot=false", "log.progress=false"]


def process_counts(limit: int) -> list[int]:
    """1, 2, 4, ... up to and including `limit`."""
    counts, n = [], 1
    while n < limit:
        counts.append(n)
        n *= 2
    return counts + [limit]


def _one_run(n: int, model: str, sets: list[str], device: str, steps: int, threads: int | None, out: Path) -> float:
    name = f"n{n}-{time.monotonic_ns()}"
    args = ["--set", f"model.name={model}", "--device", device]
    for s in [*STUDY_SETS, f"train.max_steps={steps}", *sets, f"run.dir={out}", f"run.name={name}"]:
        args += ["--set", s]
    launch = ["--nproc-per-node", str(n)] if n > 1 else []
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    done = subprocess.run([sys.executable, "-m", "gpudl", "train", *launch, *args], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"the {n}-process run failed: {last[0]}")
    return json.loads((out / name / "summary.json").read_text())["samples_per_s"]


def run_scaling(model: str = "gpt-tiny", sets: list[str] = (), device: str = "auto", max_procs: int | None = None,
                steps: int = 40, repeats: int = 2, console: Console | None = None) -> dict:
    """Samples/s and scaling efficiency for 1..N processes; N defaults to the devices (or CPU cores) present."""
    console = console or Console()
    info = detect(device)
    limit = max_procs or (info.count if info.type != "cpu" else info.compute_units or 1)
    if limit < 1:
        raise UserError(f"--max-procs must be >= 1, got {limit}")
    counts = process_counts(limit)
    out = Path(tempfile.mkdtemp(prefix="gpudl-scaling-"))
    rates: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(repeats):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            threads = max(1, (info.compute_units or 1) // n) if info.type == "cpu" else None
            rates[n].append(_one_run(n, model, list(sets), info.kind, steps, threads, out))
            console.print(f"  {n} process(es): {rates[n][-1]:,.1f} samples/s", highlight=False)
    base = statistics.median(rates[1])
    points = [{"processes": n, "samples_per_s": statistics.median(rates[n]), "runs": rates[n],
               "efficiency": statistics.median(rates[n]) / (n * base)} for n in counts]
    return {"schema": "gpudl-scaling/1", "created": datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(), "device": info.label, "model": model, "sets": list(sets), "steps": steps,
            "repeats": repeats, "points": points,
            "method": "same batch per process (weak scaling); median of the repeats; CPU cores split evenly"}


def scaling_markdown(doc: dict) -> str:
    lines = [f"# Scaling: {doc['model']} on {doc['device']}", "",
             f"{doc['created']} · {doc['machine']['cpu']} · torch {doc['machine']['versions']['torch']} · "
             f"{doc['method']}", "", "| processes | samples/s | speed-up | efficiency |", "|---|---|---|---|"]
    base = doc["points"][0]["samples_per_s"]
    for p in doc["points"]:
        lines.append(f"| {p['processes']} | {p['samples_per_s']:,.1f} | {p['samples_per_s'] / base:.2f}x | "
                     f"{100 * p['efficiency']:.0f}% |")
    return "\n".join(lines) + "\n"


def write_scaling(doc: dict, folder: Path) -> list[Path]:
    """scaling.json, scaling.md and (with matplotlib) scaling.png in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "scaling.json", folder / "scaling.md"]
    written[0].write_text(json.dumps(doc, indent=1))
    written[1].write_text(scaling_markdown(doc))
    from ..observe import plots

    if plots.available():
        written.append(plots.plot_scaling(doc, folder / "scaling.png"))
    return written
