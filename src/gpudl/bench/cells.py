"""One benchmark cell: a model trained for a few timed steps on one device, at one precision,
compiled or not.

Each step is the real training step, `train_loop`'s forward, backward, clip, finiteness check,
optimizer step and schedule, bracketed by device synchronisation so that the clock stops only
when the device has finished. Warm-up steps come first and are timed apart: with
torch.compile that is where compilation happens, reported as compile time and never counted
in the throughput. Timing stops after `Timing.steps` steps, or sooner once `max_seconds` have
passed (a slow cell on a CPU), and the JSON records how many were timed. Batches are synthetic
and already on the device (pure compute), or, for a data-loading cell, the recipe's real data
through the same `DeviceLoader` training uses."""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from .. import models
from ..config import Config
from ..data import DeviceLoader, build_data, usable_cores
from ..device import DeviceInfo, synchronize
from ..device.host import release_freed_memory
from ..observe.metrics import peak_memory_bytes, reset_peak_memory
from ..device.peak import datasheet_peak_flops, measured_peak_flops, peak_key
from ..training.precision import make_precision
from ..training.job import Task, build_job
from ..training.loop import Job, NoEvents, TrainState, train_loop
from ..distributed.session import Session

# The measured figures of a cell; a failed cell has each of them as None.
FIGURES = ("step_times_s", "samples_per_s", "units_per_s", "samples_per_s_mean", "step_s_p50", "step_s_p90",
           "step_s_mean", "cv",
           "flops_per_step", "achieved_flops", "peak_flops", "mfu", "mfu_datasheet", "peak_mem_bytes", "compile_s",
           "warmup_s", "data_wait_frac", "loader_workers")


@dataclass(frozen=True)
class Cell:
    """What one cell runs: a model's config on one device at one precision, compiled or not."""

    model: str                  # the name the user asked for (a recipe or a preset)
    spec: models.ModelSpec
    cfg: Config                 # data, train and optim settings of that model
    device: DeviceInfo
    precision: str              # a precision policy: fp32 | bf16-mixed | fp16-mixed | bf16-true
    compile: bool
    real_data: bool = False     # False: synthetic batches already on the device

    @property
    def title(self) -> str:
        data = " · real data" if self.real_data else ""
        mode = "compiled" if self.compile else "eager"
        return f"{self.model} · {self.device.kind} · {self.precision} · {mode}{data}"


def _batches(cell: Cell, device: torch.device) -> tuple[Iterator, DeviceLoader | None]:
    cfg = cell.cfg
    if cell.real_data:
        data = build_data(cfg.data, cell.spec, cfg.train.batch_size, cfg.run.seed)
        loader = DeviceLoader(data.train, device, num_workers=cfg.data.num_workers, cores=usable_cores())
        return loader, loader
    source = build_data(replace(cfg.data, kind="synthetic"), cell.spec, cfg.train.batch_size, cfg.run.seed).train
    # A few distinct batches, placed once and cycled: the loop waits on nothing but the device.
    placed = [tuple(t.to(device) for t in source.batch(k)) for k in range(4)]
    return itertools.cycle(placed), None


def _job(cell: Cell, total_steps: int) -> tuple[Job, DeviceLoader | None]:
    """The cell's job, assembled as training assembles it (`build_job`), on one device."""
    info = cell.device
    precision = make_precision(cell.precision, info)  # raises for a precision the device cannot run
    cfg = replace(cell.cfg, train=replace(cell.cfg.train, compile=cell.compile, max_steps=total_steps))
    model = models.build(cell.spec, info.torch_device, precision.param_dtype, seed=cfg.run.seed)
    batches, loader = _batches(cell, info.torch_device)
    return build_job(model, cfg, Session(info), precision, Task(models.loss_for(cell.spec), batches,
                                                                  draws=cfg.train.grad_accum)), loader


@dataclass(frozen=True)
class Timing:
    """How long a cell runs: untimed warm-up, then timed steps until `steps` or `max_seconds`."""

    steps: int = 30               # timed steps at most: the repeat count when time allows
    warmup: int = 2
    max_seconds: float = 10.0     # stop timing after this long, once `min_steps` are done
    min_steps: int = 3

    def warmup_for(self, cell: Cell) -> int:
        return max(self.warmup, int(cell.compile))  # compilation must never be timed as a step


def _timed_steps(job: Job, cell: Cell, state: TrainState, tick: Callable[[], None], most: int,
                 seconds: float = float("inf"), least: int = 0) -> list[float]:
    """Per-step seconds of up to `most` steps; stop early once `seconds` have passed and `least` are done."""
    device = cell.device.torch_device
    cfg = replace(cell.cfg.train, eval_every=0)
    times = []
    while len(times) < most and (len(times) < least or sum(times) < seconds):
        one_more = replace(cfg, max_steps=state.step + 1)
        synchronize(device)
        t0 = time.perf_counter()
        train_loop(job, one_more, state, NoEvents())
        synchronize(device)
        times.append(time.perf_counter() - t0)
        tick()
    return times


def _figures(cell: Cell, times: list[float], warm: list[float], flops_per_sample: int | None, peak: float,
             datasheet: float | None) -> dict:
    train = cell.cfg.train
    samples = train.batch_size * train.grad_accum
    p50 = statistics.median(times)
    mean = statistics.fmean(times)
    flops = flops_per_sample * samples if flops_per_sample else None  # None: the counter could not follow the model
    return {
        "steps": len(times), "step_times_s": times,
        "samples_per_s": samples / p50, "units_per_s": samples / p50 * units_per_sample(cell.spec),
        "samples_per_s_mean": samples / mean,
        "step_s_p50": p50, "step_s_p90": _percentile(times, 0.9), "step_s_mean": mean,
        "cv": statistics.pstdev(times) / mean if len(times) > 1 else 0.0,
        "flops_per_step": flops, "achieved_flops": flops and flops / p50, "peak_flops": peak,
        "mfu": flops and flops / p50 / peak,
        "mfu_datasheet": flops and datasheet and flops / p50 / datasheet,  # None: no datasheet figure (a CPU)
        "warmup_s": sum(warm),
        # What the warm-up cost beyond steady steps: compilation, for a compiled model.
        "compile_s": max(0.0, sum(warm) - len(warm) * p50) if cell.compile else None,
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _measure(cell: Cell, timing: Timing, flops_per_sample: int | None, tick: Callable[[], None]) -> dict:
    warmup = timing.warmup_for(cell)
    job, loader = _job(cell, warmup + timing.steps)
    key = peak_key(job.precision.name)
    peak, datasheet = measured_peak_flops(cell.device, key), datasheet_peak_flops(cell.device, key)
    state = TrainState()
    warm = _timed_steps(job, cell, state, tick, warmup)
    waited = loader.wait_s if loader else 0.0
    times = _timed_steps(job, cell, state, tick, timing.steps, timing.max_seconds, timing.min_steps)
    out = _figures(cell, times, warm, flops_per_sample, peak, datasheet)
    out["peak_mem_bytes"] = peak_memory_bytes(cell.device.torch_device)
    if loader is not None:
        out["data_wait_frac"] = min(1.0, (loader.wait_s - waited) / sum(times))
        out["loader_workers"] = loader.workers
        loader.close()
    return out


def run_cell(cell: Cell, timing: Timing, flops_per_sample: int | None, tick: Callable[[], None] = lambda: None) -> dict:
    """Measure one cell; a failure (out of memory, say) is recorded with its reason, not raised.

    `tick` is called after every step (warm-up included), for a progress bar.
    """
    record = describe(cell, timing)
    t0 = time.perf_counter()
    _clear(cell.device.torch_device, cell.compile)
    try:
        record.update(_measure(cell, timing, flops_per_sample, tick), status="ok")
    except Exception as e:  # noqa: BLE001 -- any failure of one cell is its result; the suite goes on
        record.update(status="failed", reason=failure_reason(e))
    _clear(cell.device.torch_device, cell.compile)  # the model, optimizer and loader of _measure are gone
    record["wall_s"] = time.perf_counter() - t0
    return record


def units_per_sample(spec: models.ModelSpec) -> int:
    return spec.config.block_size if spec.is_language_model else 1


def describe(cell: Cell, timing: Timing) -> dict:
    """The cell's settings, with every figure still None."""
    train = cell.cfg.train
    return {
        "model": cell.model, "device": cell.device.label, "device_kind": cell.device.kind,
        "precision": cell.precision, "compile": cell.compile, "data": "real" if cell.real_data else "synthetic",
        "status": "pending", "reason": None, "batch_size": train.batch_size, "grad_accum": train.grad_accum,
        "unit": "tokens" if cell.spec.is_language_model else "images", "units_per_sample": units_per_sample(cell.spec),
        "warmup_steps": timing.warmup_for(cell), "steps": None, "speedup_vs_cpu": None, "wall_s": None,
        **dict.fromkeys(FIGURES),
    }


def failure_reason(e: BaseException) -> str:
    """One line: what failed and its message's first line."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of memory: {first}"
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _clear(device: torch.device, compiled: bool) -> None:
    """Start a cell from a clean slate: no memory or compiled code of the cell before it."""
    gc.collect()
    if compiled:
        torch.compiler.reset()  # each compiled cell compiles afresh, and never hits the recompile limit
    if device.type == "cpu":
        release_freed_memory()
    else:
        module = torch.get_device_module(device.type)
        if hasattr(module, "empty_cache"):
            module.empty_cache()
    reset_peak_memory(device)
