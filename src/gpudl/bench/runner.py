"""Run a checked benchmark plan: device peaks, model costs, every cell with live progress, then findings.

Returns the benchmark document (the JSON that report.py writes): machine, versions, the
measured peaks and bandwidth of each device, each model's FLOPs and bytes, every cell, and the
data-loading finding per model.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from datetime import datetime

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import models
from ..version import __version__
from ..device import cpu_info
from ..device.host import keep_freed_memory
from ..device.peak import measured_peak_flops, peak_key, refresh_peaks
from ..observe.sinks import mfu_text
from . import dataload
from .cells import Cell, run_cell
from .roofline import bytes_per_step, measured_bandwidth
from .suite import Plan, flops_per_sample, sample_batch, speedups

SCHEMA = "gpudl-bench/1"
DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def machine() -> dict:
    """Where the figures come from: host, CPU and the versions that shape them."""
    cpu = cpu_info()
    return {"platform": platform.platform(), "python": sys.version.split()[0], "cpu": cpu.name,
            "cpu_cores": cpu.compute_units, "cpu_isa": cpu.capability, "cpu_threads_torch": torch.get_num_threads(),
            "versions": {"gpudl": __version__, "torch": torch.__version__, **cpu.versions}}


def device_figures(plan: Plan) -> list[dict]:
    """Measured peak FLOP/s (for each precision benchmarked there) and memory bandwidth of each device."""
    out = []
    for info in plan.devices:
        refresh_peaks(info)
        keys = sorted({peak_key(p) for p in plan.precisions[info.label]} & set(info.precisions()))
        out.append({"label": info.label, "kind": info.kind, "name": info.name, "memory_bytes": info.memory_bytes,
                    "compute_units": info.compute_units, "versions": info.versions,
                    "peak_flops": {k: measured_peak_flops(info, k) for k in keys},
                    "bandwidth_bytes_per_s": measured_bandwidth(info, refresh=True)})
    return out


def model_figures(plan: Plan) -> dict[str, dict]:
    """Per model: parameters, FLOPs per sample and bytes per step per dtype (meta device, no compute)."""
    out = {}
    dtypes = sorted({peak_key(p) for ps in plan.precisions.values() for p in ps})
    for name, cfg in plan.configs.items():
        spec = plan.specs[name]
        fig = {"name": name, "preset": spec.name, "description": models.describe(spec),
               "params": models.parameter_count(spec),
               "batch_size": cfg.train.batch_size, "flops_per_sample": None, "bytes_per_step": {}, "error": None}
        try:
            fig["flops_per_sample"] = flops_per_sample(spec, cfg)
            batch = sample_batch(spec, cfg)
            fig["bytes_per_step"] = {d: bytes_per_step(spec, batch, DTYPE_OF[d]) for d in dtypes}
        except Exception as e:  # noqa: BLE001 -- a model the counters cannot follow still runs; no MFU then
            fig["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[name] = fig
    return out


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def run_cells(plan: Plan, costs: dict[str, dict], console: Console) -> list[dict]:
    """Every cell in turn, with a bar for the grid and one for the cell's steps."""
    cells = plan.cells()
    results = []
    with _progress(console) as progress:
        grid = progress.add_task("benchmark", total=len(cells))
        for cell in cells:
            task = progress.add_task(f"  {cell.title}", total=plan.timing.warmup_for(cell) + plan.timing.steps)
            rec = run_cell(cell, plan.timing, costs[cell.model]["flops_per_sample"],
                           tick=lambda t=task: progress.advance(t))
            _add_intensity(rec, costs[cell.model])
            progress.remove_task(task)
            progress.advance(grid)
            console.print(cell_line(cell, rec), highlight=False, markup=False)
            results.append(rec)
    return results


def _add_intensity(rec: dict, cost: dict) -> None:
    moved = cost["bytes_per_step"].get(peak_key(rec["precision"]))
    rec["bytes_per_step"] = moved
    rec["intensity"] = rec["flops_per_step"] / moved if rec["flops_per_step"] and moved else None


def cell_line(cell: Cell, rec: dict) -> str:
    """One line per finished cell, printed above the progress bars."""
    if rec["status"] != "ok":
        return f"✗ {cell.title}: failed ({rec['reason']})"
    known = rec["mfu"] is not None or rec["mfu_datasheet"] is not None
    mfu = f" · MFU {mfu_text(rec['mfu'], rec['mfu_datasheet'])}" if known else ""
    comp = f" · compile {rec['compile_s']:.1f} s (not timed)" if rec["compile_s"] is not None else ""
    wait = f" · waits for data {100 * rec['data_wait_frac']:.1f}% of each step" if cell.real_data else ""
    return (f"✓ {cell.title}: {rec['samples_per_s']:,.1f} samples/s · step {1e3 * rec['step_s_p50']:.1f} ms"
            f"{mfu}{comp}{wait}")


def loader_findings(plan: Plan, cells: list[dict]) -> list[dict]:
    """Per model, the real-data cell against the same synthetic cell."""
    out = []
    first = plan.devices[0]
    cores = cpu_info().compute_units or 1
    for name, cfg in plan.configs.items():
        real = next(c for c in cells if c["model"] == name and c["data"] == "real")
        synthetic = next((c for c in cells if c["model"] == name and c["data"] == "synthetic"
                          and c["device"] == first.label and c["precision"] == real["precision"]
                          and not c["compile"]), None)
        workers = real.get("loader_workers")  # what data.num_workers (auto, say) came to in the cell
        out.append(dataload.verdict(real, synthetic, workers if workers is not None else 0, cores))
    return out


def run_plan(plan: Plan, console: Console, command: str | None = None) -> dict:
    """Measure everything the plan asks for; returns the benchmark document."""
    started = datetime.now().astimezone()
    t0 = time.perf_counter()
    if any(i.type == "cpu" for i in plan.devices):
        keep_freed_memory()  # what a training run on the CPU does, so the CPU figures are a run's figures
    console.print("Devices: " + ", ".join(i.label for i in plan.devices))
    console.print("Measuring peak FLOP/s and memory bandwidth (kept at the best seen on this machine) ...")
    devices = device_figures(plan)
    costs = model_figures(plan)
    cells = run_cells(plan, costs, console)
    speedups(cells)
    return {
        "schema": SCHEMA, "created": started.isoformat(timespec="seconds"), "command": command,
        "duration_s": time.perf_counter() - t0, "machine": machine(),
        "settings": {**dataclasses.asdict(plan.timing), "compile": list(plan.compile),
                     "precisions": plan.precisions, "models": list(plan.configs),
                     "timing": "each step synchronised; samples/s and MFU from the median step time; a cell times "
                               "`steps` steps, or fewer (at least `min_steps`) once `max_seconds` have passed"},
        "devices": devices, "models": list(costs.values()), "cells": cells,
        "loader": loader_findings(plan, cells), "plots": [],
        "env": {k: v for k, v in os.environ.items() if k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")},
    }


__all__ = ["run_plan", "SCHEMA", "machine"]
