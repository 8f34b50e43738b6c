"""Running a prepared job: metrics and checkpoints around the loop, the summary at the end.

Shared by `gpudl.train` (recipes) and `gpudl.fit` (any nn.Module).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from ..checkpoint import Checkpointer
from ..checkpoint.background import BackgroundWriter, choose, host_available_bytes, state_bytes
from ..config import Config
from ..data import DeviceLoader
from ..distributed.agree import any_rank
from ..device.peak import datasheet_peak_flops, measured_peak_flops, peak_key
from ..distributed.watch import is_peer_lost, is_timeout
from ..observe.metrics import Throughput, peak_memory_bytes, reset_peak_memory
from ..observe.plots import plot_loss
from ..observe.sinks import ConsoleProgress, FileSink, TensorBoardSink, read_records, summary_table, \
    tensorboard_available
from .budget import StepBudget
from .interrupt import StopRequest
from ..training.finite import NonFiniteError
from ..training.loop import Job, TrainState, train_loop
from .monitor import Monitor, Saver
from ..distributed.session import Session
from ..training.spikes import SpikeLog, SpikeVeto


@dataclass(frozen=True)
class Workload:
    """What one sample of a job is and costs: for throughput, MFU and the summary."""

    name: str                    # the model's name
    unit: str                    # what throughput counts: "tokens", "images" or "samples"
    units_per_sample: int
    flops_per_sample: int        # forward + backward; 0 when they could not be counted
    n_params: int                # the whole model's (a pipeline rank holds a part)
    mfu_note: str | None = None  # why MFU is not reported, when the FLOPs could not be counted


@dataclass
class Execution:
    """A job ready to run, and where its results go."""

    session: Session
    job: Job
    cfg: Config                  # its train, log and checkpoint sections
    state: TrainState
    loader: DeviceLoader
    work: Workload
    run_dir: Path | None = None
    checkpointer: Checkpointer | None = None
    background: BackgroundWriter | None = None  # checkpoint.async: the checkpointer's saves finish on a thread


@dataclass
class Outcome:
    summary: dict
    records: list[dict]


def _sinks(ex: Execution, resume_step: int | None) -> list:
    if ex.run_dir is None or not ex.session.is_writer:
        return []
    sinks = [FileSink(ex.run_dir, resume_step)]
    if ex.cfg.log.tensorboard is True or (ex.cfg.log.tensorboard == "auto" and tensorboard_available()):
        sinks.append(TensorBoardSink(ex.run_dir))
    return sinks


def make_monitor(ex: Execution, console: Console, sinks: list) -> Monitor:
    train, session = ex.cfg.train, ex.session
    key = peak_key(ex.job.precision.name)
    samples_per_step = train.batch_size * train.grad_accum * session.dp[1]  # the whole job's
    throughput = Throughput(samples_per_step, ex.work.units_per_sample, ex.work.flops_per_sample * samples_per_step,
                            measured_peak_flops(session.device, key), world=session.world,
                            datasheet_flops=datasheet_peak_flops(session.device, key))
    progress = ConsoleProgress(console, train.max_steps, ex.state.step, ex.work.unit,
                               enabled=ex.cfg.log.progress and session.is_writer, quiet=not session.is_writer)
    saver = Saver(ex.checkpointer, ex.job, ex.cfg.checkpoint.every, ex.background) \
        if ex.checkpointer is not None else None
    budget = StepBudget(ex.cfg, session, ex.job, progress, _config_writer(ex)) \
        if StepBudget.wanted(ex.cfg, ex.state) else None
    veto = ex.job.spike_veto if isinstance(ex.job.spike_veto, SpikeVeto) else None
    spikes = SpikeLog(train, ex.cfg.optim.warmup_steps, veto, ex.state) if train.spike_factor else None
    return Monitor(session=session, train=train, throughput=throughput, sinks=sinks, progress=progress,
                   loader=ex.loader, saver=saver, watch=session.watch(), budget=budget, spikes=spikes)


def background_saves(cfg: Config, session: Session, ckpt: Checkpointer,
                     job: Job) -> tuple[BackgroundWriter | None, str]:
    """The writer of checkpoint.async (None: saves block the step), and why, the same on every rank."""
    ranks_here = session.env.local_world_size if session.env is not None else 1
    on_cpu_limit = session.device.type == "cpu" and bool(cfg.train.memory_limit)
    on, why = choose(cfg.checkpoint.async_save, state_bytes(job.model, job.optimizer) * ranks_here,
                     host_available_bytes(), on_cpu_limit)
    if session.world > 1:  # off where any node lacks the memory
        agreed = not any_rank(not on, session.control)
        why = why if agreed == on else "auto: off, another node has not the host memory for the buffers"
        on = agreed
    if not on:
        return None, why
    pin = session.device.type != "cpu" and torch.accelerator.is_available()
    return BackgroundWriter(ckpt, pin, session.timeout_s), why


def _config_writer(ex: Execution):
    """Rewrites the run's config.toml with what the run decided (rank 0; nothing without a run folder)."""
    def write(cfg: Config) -> None:
        if ex.run_dir is not None and ex.session.is_writer and (ex.run_dir / "config.toml").exists():
            (ex.run_dir / "config.toml").write_text(cfg.to_toml())
    return write


def execute(ex: Execution, console: Console) -> Outcome:
    """Run the loop with metrics and checkpoints; then summary, plot and table."""
    resume_step = ex.state.step if ex.state.step else None
    sinks = _sinks(ex, resume_step)
    monitor = make_monitor(ex, console, sinks)
    reset_peak_memory(ex.session.device.torch_device)
    t0 = time.perf_counter()
    try:
        with monitor.progress, StopRequest(ex.session.control, announce=ex.session.is_writer) as stop:
            monitor.stop = stop
            monitor.throughput.restart()
            monitor.note(ex.state.step + 1, "training step")
            train_loop(ex.job, ex.cfg.train, ex.state, monitor)
            if ex.background is not None:  # the last save (or a stop's) is complete before anything reads it
                ex.background.close()
    except RuntimeError as e:
        if monitor.watch is not None and is_timeout(e):
            raise monitor.watch.diagnose(e) from e
        if monitor.watch is not None and is_peer_lost(e):
            raise monitor.watch.lost(e) from e
        raise
    finally:
        if ex.background is not None:  # failing: the write in flight still lands (a checkpoint to resume from)
            ex.background.close(raise_error=False)
        for sink in sinks:
            sink.close()
    summary = summarize(ex, monitor.records, time.perf_counter() - t0)
    if stop.signum:
        summary["stopped_by"] = stop.name
    if ex.run_dir is not None and ex.session.is_writer:
        (ex.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if ex.cfg.log.plot:
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

    def known_mean(key):  # MFU: None where the records do not know it (no FLOP count, no datasheet figure)
        known = [r[key] for r in steady if r.get(key) is not None]
        return sum(known) / len(known) if known else None

    info, sheet = ex.session.device, known_mean("mfu_datasheet")
    return {
        "model": ex.work.name,
        "device": info.label, "precision": ex.job.precision.name, "steps": ex.state.step,
        "final_loss": train[-1]["loss"] if train else float("nan"),
        **({f"val_{k}": v for k, v in evals[-1].items() if k not in ("kind", "step")} if evals else {}),
        "samples_per_s": mean("samples_per_s"), f"{ex.work.unit}_per_s": mean("units_per_s"), "mfu": known_mean("mfu"),
        **({"mfu_datasheet": sheet} if sheet is not None else {}),
        "processes": ex.session.world, f"{ex.work.unit}_per_s_per_device": mean("units_per_s") / ex.session.world,
        "step_s": mean("step_s"), "data_wait_frac": mean("data_wait_frac"),
        "peak_mem_gb": peak_memory_bytes(info.torch_device) / 2**30,
        "nonfinite_steps": ex.state.nonfinite_total, "loss_spikes": ex.state.spikes, "wall_s": wall_s,
        "params_m": ex.work.n_params / 1e6, "flops_per_sample": ex.work.flops_per_sample,
        **({"mfu_note": ex.work.mfu_note} if ex.work.mfu_note else {}),
        "run_dir": str(ex.run_dir) if ex.run_dir else None,
        "torch": str(torch.__version__),
    }
