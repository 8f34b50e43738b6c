"""Running a prepared job: metrics and checkpoints around the loop, the summary at the end.

Shared by `gpudl.train` (recipes) and `gpudl.fit` (any nn.Module).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from ..checkpoint import Checkpointer
from ..config import LogConfig, TrainConfig
from ..data import DeviceLoader
from ..distributed.watch import Progress, is_timeout
from .interrupt import StopRequest
from ..observe.metrics import Throughput, peak_memory_bytes, reset_peak_memory
from .monitor import Monitor
from ..device.peak import measured_peak_flops, peak_key
from ..observe.plots import plot_loss
from .session import Session
from ..observe.sinks import ConsoleProgress, FileSink, TensorBoardSink, summary_table, tensorboard_available
from .loop import Job, NonFiniteError, TrainState, train_loop


@dataclass
class Execution:
    """A job ready to run, and where its results go."""

    session: Session
    job: Job
    train: TrainConfig
    log: LogConfig
    state: TrainState
    loader: DeviceLoader
    model_name: str
    unit: str                    # "tokens", "images" or "samples"
    units_per_sample: int
    flops_per_sample: int
    run_dir: Path | None = None
    checkpointer: Checkpointer | None = None
    save_every: int = 0
    n_params: int | None = None  # the whole model's; None: count job.model's (a pipeline rank holds a part)
    mfu_note: str | None = None  # why MFU is not reported (the FLOPs could not be counted); in the summary


@dataclass
class Outcome:
    summary: dict
    records: list[dict]


def _sinks(ex: Execution, resume_step: int | None) -> list:
    if ex.run_dir is None or not ex.session.is_writer:
        return []
    sinks = [FileSink(ex.run_dir, resume_step)]
    if ex.log.tensorboard is True or (ex.log.tensorboard == "auto" and tensorboard_available()):
        sinks.append(TensorBoardSink(ex.run_dir))
    return sinks


def _save_fn(ex: Execution):
    if ex.checkpointer is None:
        return None
    job = ex.job

    def save(state: TrainState) -> None:
        extra = {"train_state": dataclasses.asdict(state), "scheduler": job.scheduler.state_dict(),
                 "scaler": job.precision.state_dict()}
        ex.checkpointer.save(state.step, job.model, job.optimizer, extra)
    return save


def make_monitor(ex: Execution, console: Console, sinks: list, watch: Progress | None = None) -> Monitor:
    info = ex.session.device
    peak = measured_peak_flops(info, peak_key(ex.job.precision.name))
    samples_per_step = ex.train.batch_size * ex.train.grad_accum * ex.session.dp[1]  # the whole job's
    throughput = Throughput(samples_per_step, ex.units_per_sample, ex.flops_per_sample * samples_per_step,
                            peak, world=ex.session.world)
    progress = ConsoleProgress(console, ex.train.max_steps, ex.state.step, ex.unit,
                               enabled=ex.log.progress and ex.session.is_writer, quiet=not ex.session.is_writer)
    return Monitor(throughput=throughput, device=info.torch_device, log_every=ex.train.log_every,
                   max_steps=ex.train.max_steps, sinks=sinks, progress=progress,
                   data_wait=lambda: ex.loader.wait_s, save=_save_fn(ex), save_every=ex.save_every,
                   reduce=ex.session.reduce_mean, note=watch.note if watch else (lambda step, phase: None))


def execute(ex: Execution, console: Console) -> Outcome:
    """Run the loop with metrics and checkpoints; then summary, plot and table."""
    resume_step = ex.state.step if ex.state.step else None
    sinks = _sinks(ex, resume_step)
    watch = ex.session.watch()
    monitor = make_monitor(ex, console, sinks, watch)
    reset_peak_memory(ex.session.device.torch_device)
    t0 = time.perf_counter()
    try:
        with monitor.progress, StopRequest(ex.session.control, announce=ex.session.is_writer) as stop:
            monitor.stop = stop
            monitor.throughput.restart()
            monitor.note(ex.state.step + 1, "training step")
            train_loop(ex.job, ex.train, ex.state, monitor)
    except RuntimeError as e:
        if watch is not None and is_timeout(e):
            raise watch.diagnose(e) from e
        raise
    finally:
        for sink in sinks:
            sink.close()
    summary = summarize(ex, monitor.records, time.perf_counter() - t0)
    if stop.signum:
        summary["stopped_by"] = stop.name
    if ex.run_dir is not None and ex.session.is_writer:
        (ex.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if ex.log.plot:
            from ..observe.sinks import read_records

            plot = plot_loss(read_records(ex.run_dir), ex.run_dir / "loss", f"{summary['model']} loss")
            summary["plot"] = str(plot)
    console.print(summary_table(summary))
    skipped = ex.state.nonfinite_in_a_row
    if skipped and "stopped_by" not in summary:  # the run "finished", but its last updates never happened
        raise NonFiniteError(f"the last {skipped} of {ex.state.step} steps had NaN/Inf gradients and were skipped, "
                             f"so the weights are those of step {ex.state.step - skipped}: lower optim.lr, use "
                             f"precision=bf16-mixed or fp32, or check the data")
    return Outcome(summary, monitor.records)


def summarize(ex: Execution, records: list[dict], wall_s: float) -> dict:
    """The run's headline figures; rates average the log windows after the first (warm-up)."""
    train = [r for r in records if r["kind"] == "train"]
    steady = train[1:] or train
    evals = [r for r in records if r["kind"] == "eval"]

    def mean(key):
        return sum(r[key] for r in steady) / len(steady) if steady else 0.0

    info = ex.session.device
    return {
        "model": ex.model_name,
        "device": info.label, "precision": ex.job.precision.name, "steps": ex.state.step,
        "final_loss": train[-1]["loss"] if train else float("nan"),
        **({f"val_{k}": v for k, v in evals[-1].items() if k not in ("kind", "step")} if evals else {}),
        "samples_per_s": mean("samples_per_s"), f"{ex.unit}_per_s": mean("units_per_s"), "mfu": mean("mfu"),
        "processes": ex.session.world, f"{ex.unit}_per_s_per_device": mean("units_per_s") / ex.session.world,
        "step_s": mean("step_s"), "data_wait_frac": mean("data_wait_frac"),
        "peak_mem_gb": peak_memory_bytes(info.torch_device) / 2**30,
        "nonfinite_steps": ex.state.nonfinite_total, "wall_s": wall_s,
        "params_m": (ex.n_params or sum(p.numel() for p in ex.job.model.parameters())) / 1e6,
        "flops_per_sample": ex.flops_per_sample,
        **({"mfu_note": ex.mfu_note} if ex.mfu_note else {}),
        "run_dir": str(ex.run_dir) if ex.run_dir else None,
        "torch": str(torch.__version__),
    }
