"""Measured peak of live tensor bytes per rank in one steady-state training step, on the CPU.

The measurement side of the memory-accuracy benchmark: what the memory estimator predicts is
compared with what this module sees. It shares no code with the estimator. Each rank builds
its job exactly as `gpudl.run.recipe.train` does (config -> session -> preflight -> layout
-> model and data -> `recipe_job`, which is `build_job`, then the `DeviceLoader`), with every
CPU allocation and free recorded from before the job is built, and runs two real training steps
with `train_loop` (forward, backward, clip, finiteness check, optimizer step, zero_grad). The
second step is the steady state: optimizer state exists. Reported per rank (bytes):

    baseline_bytes   live at the start of step 2 (parameters, optimizer state, DDP buckets, the batch, ...)
    peak_bytes       the most live at any moment of step 2 (baseline included)
    step_peak_bytes  peak_bytes - baseline_bytes: what the step itself adds at its worst
    end_bytes        live at the end of step 2
    held_bytes       the storages reachable at the end from the model's parameters, buffers and
                     gradients and the optimizer's state (a check: end_bytes is held_bytes plus the
                     batch the loader has made ahead, plus DDP's buckets or a pipeline's buffers)
    seconds          the rank's wall time (start, build, two recorded steps, reading the record)

Live bytes over time are the running sum of the signed allocation sizes, counted only for
allocations made inside the recording (earlier ones, and their frees, are not counted).
Two sources of those sizes, `method=`:

  "c10-log" (the default): c10's CPU allocator reporter. With `FLAGS_caffe2_report_cpu_memory_usage`
      set (through ctypes) the allocator logs every allocation and free, of every thread, with the
      process-wide live total ("C10 alloc N bytes, total alloc M bytes."); the log goes to a file
      through fd 2, with a marker line written at each step boundary.
  "profiler": `torch.profiler.profile(activities=[CPU], profile_memory=True)`, its "[memory]"
      events, with `record_function` markers around each step. Exact for one process (it agrees
      with "c10-log" to the byte), but the profiler records an allocation or a free only on a
      thread that carries its thread-local state: gloo's worker threads do not, so in a
      multi-process job the tensors a collective allocates are missed, and a tensor whose last
      reference dies on a gloo thread (FSDP's and tensor parallelism's collective buffers) is
      never seen freed and inflates every later figure (gpt2-124m FSDP: +54 MiB; gpt-tiny TP:
      rank 1's baseline +5.6 MiB and growing). `experimental_config=_ExperimentalConfig(
      profile_all_threads=True)` records no memory events at all (torch 2.13).
  "allocator" (what a case on an accelerator uses): the device's caching allocator's own counters,
      `torch.cuda.memory_allocated` at the step's start and end and `torch.cuda.max_memory_allocated`
      over the step (its peak reset at the start), each less what was allocated before the job was
      built. No c10 log or profiler: they see host memory, and the job's tensors are on the device.

As a script (prints one line per rank; its scratch folder is removed):

    python benchmarks/memory_measure.py --model gpt-tiny --batch-size 8 --strategy ddp --world 2 \\
        [--precision bf16-mixed] [--ac] [--set block_size=64] [--method profiler]

As a module (from another script in benchmarks/):

    from memory_measure import Case, measure
    ranks = measure(Case("gpt-tiny", 8, strategy="ddp", world=2), Path("/tmp/mm"))
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Run as a script this folder is on sys.path already; loaded by file path (the tests) it is not: add it for memory_observers.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from memory_observers import (C10AllocationLog, DeviceCounters, held_tensors, live_bytes, profiler_deltas,  # noqa: E402
                              storage_bytes)

MiB = 2**20
STRATEGIES = ("single", "ddp", "fsdp", "tp", "pp")
METHODS = ("c10-log", "profiler", "allocator")
INIT_ENV = "GPUDL_MEMORY_MEASURE_INIT"      # the rendezvous (file://...) a rank passes to start_session
STEP_MARK = "memory_measure/step{}"         # record_function names around each training step
# Variables by which a process would think it belongs to a job: a world-1 case must not inherit them.
JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
           "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_NTASKS")


@dataclass(frozen=True)
class Case:
    """One measured job: a gpudl preset trained at one batch size, precision and layout."""

    model: str                    # a gpudl preset: "gpt-tiny", "gpt2-124m", "resnet18", "resnet50"
    batch_size: int               # per rank (micro-batch)
    precision: str = "fp32"       # "fp32" | "bf16-mixed"
    activation_checkpointing: bool | str = False  # or "selective"
    strategy: str = "single"      # "single" | "ddp" | "fsdp" | "tp" | "pp"
    world: int = 1                # processes (2 for every strategy but single)
    device: str = "cpu"           # "cpu", or "cuda": measured with the device allocator's counters
    # Model settings, e.g. (("block_size", 256),); a dotted key is a config key ("data.image_size").
    overrides: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if (self.strategy == "single") != (self.world == 1):
            raise ValueError(f"strategy {self.strategy!r} with world={self.world}: "
                             f"'single' runs 1 process, every other strategy 2 or more")

    def config_sets(self) -> list[str]:
        """The `--set key=value` list that makes this case's gpudl config."""
        sets = [f"model.name={self.model}", f"train.batch_size={self.batch_size}",
                f"train.precision={self.precision}",
                f"train.activation_checkpointing={_toml(self.activation_checkpointing)}",
                "train.compile=false", "train.attention=sdpa", "data.kind=synthetic", f"run.device={self.device}"]
        if self.strategy == "pp":  # defaults an override may change ("parallel.pp_schedule", "parallel.pp_microbatches")
            sets += ["model.tie_embeddings=false", "parallel.pp_microbatches=2"]
        w = self.world
        degrees = {"single": {}, "ddp": {"dp_replicate": w, "dp_shard": 1}, "fsdp": {"dp_replicate": 1, "dp_shard": w},
                   "tp": {"dp_replicate": 1, "dp_shard": 1, "tp": w},
                   "pp": {"dp_replicate": 1, "dp_shard": 1, "pp": w}}[self.strategy]
        sets += [f"parallel.{k}={v}" for k, v in degrees.items()]
        # after the degrees: an override may split them (HSDP: parallel.dp_replicate=2 of an fsdp x4 case)
        sets += [f"{key if '.' in key else 'model.' + key}={_toml(value)}" for key, value in self.overrides]
        return sets

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Case:
        d = json.loads(text)
        return cls(**{**d, "overrides": tuple((k, v) for k, v in d["overrides"])})

    @property
    def title(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.overrides)
        ac = {True: " +ac", "selective": " +sac"}.get(self.activation_checkpointing, "")
        on = "" if self.device == "cpu" else f" on {self.device}"
        return f"{self.model} b{self.batch_size} {self.precision}{ac} {self.strategy}x{self.world}{extra}{on}"


def _toml(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------------------------------------
# One rank: the job built and stepped by gpudl's own code, measured.

# What the two functions below import, in their order: imported before a rank's clock starts.
RANK_MODULES = ("rich.console", "torch.profiler", "gpudl.config", "gpudl.data", "gpudl.distributed.preflight",
                "gpudl.training.loop", "gpudl.training.precision", "gpudl.training.job", "gpudl.run.recipe",
                "gpudl.distributed.session")


def measure_this_process(case: Case, method: str = "c10-log", scratch: Path | None = None) -> dict:
    """Build `case`'s job in this process (a rank of a job when RANK/WORLD_SIZE are set) and measure it."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    for module in RANK_MODULES:  # before the clock starts: `seconds` leaves the imports out
        importlib.import_module(module)
    t0 = time.perf_counter()
    cfg, session, precision, spec, data = _start_rank(case)
    log = None
    if method == "c10-log":
        name = f"c10-rank{session.rank}.log" if scratch else f"gpudl-memory-c10-{os.getpid()}.log"
        log = C10AllocationLog(Path(scratch or tempfile.gettempdir()) / name)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if method == "profiler" else None
    counters = DeviceCounters() if method == "allocator" else None
    job, t_step = _build_job_and_record_two_steps(cfg, session, precision, spec, data, log or counters, prof)
    if counters:
        window = counters.window()
    elif prof:
        deltas, marks = profiler_deltas(prof)
        if STEP_MARK.format(2) not in marks:
            raise RuntimeError(f"the profiler recorded no {STEP_MARK.format(2)!r} marker: cannot find step 2")
        window = live_bytes(deltas, *marks[STEP_MARK.format(2)])
        del prof, deltas
    else:
        window = log.window("step2-begin", "step2-end")
        log.path.unlink()
    held = storage_bytes(held_tensors(job.model, job.optimizer))
    result = {"rank": session.rank, **window, "held_bytes": held, "step_seconds": t_step,
              "seconds": time.perf_counter() - t0, "method": method, "threads": torch.get_num_threads()}
    if session.world > 1:
        dist.barrier()
    return result


def _start_rank(case: Case) -> tuple:
    """What `recipe.train` has before it builds the job: (config, session, precision, model spec, data)."""
    from rich.console import Console

    from gpudl.config import load_config
    from gpudl.distributed.preflight import check_job
    from gpudl.training.precision import make_precision
    from gpudl.training.job import model_and_data
    from gpudl.distributed.session import plan_parallel, start_session

    cfg = load_config(None, case.config_sets())
    session = start_session(cfg.run, Console(quiet=True), cfg.parallel.timeout_s, init_method=os.environ.get(INIT_ENV),
                            offload=cfg.parallel.fsdp_cpu_offload)
    if session.world != case.world:
        raise RuntimeError(f"{case.title}: this process is in a job of {session.world} processes, not {case.world}")
    precision = make_precision(cfg.train.precision, session.device)
    check_job(cfg, session.world, precision.name)
    plan_parallel(session, cfg.parallel)  # every case sets its degrees: nothing is left to decide
    spec, data = model_and_data(cfg, *session.dp)
    return cfg, session, precision, spec, data


def _build_job_and_record_two_steps(cfg, session, precision, spec, data, log, prof) -> tuple:
    """(job, step 2's seconds): the job built and stepped twice with `log` and/or `prof` recording."""
    import torch.distributed as dist
    from torch.profiler import record_function

    from gpudl.data import DeviceLoader
    from gpudl.training.loop import NoEvents, TrainState, train_loop
    from gpudl.run.recipe import recipe_job

    if session.world > 1:
        dist.barrier()  # no rank's build overlaps another's steps: each measures its own process anyway
    if log:
        log.start()
    if prof:
        prof.start()
    try:
        job, _ = recipe_job(cfg, spec, data, session, precision)
        # train_loop evaluates at its last step (`max_steps`), and each call here is a last step:
        # a training run evaluates only every `eval_every` steps, so step 2 is measured without it.
        job.eval_batches = None
        # The loader a training run feeds the loop with: batch k+1 is made (and placed) when batch k is taken.
        job.batches = DeviceLoader(data.train, session.device.torch_device, num_workers=cfg.data.num_workers)
        state = TrainState()
        for step in (1, 2):
            one = dataclasses.replace(cfg.train, max_steps=state.step + 1, eval_every=0)
            if log:
                log.mark(f"step{step}-begin")
            with record_function(STEP_MARK.format(step)):
                t_step = time.perf_counter()
                train_loop(job, one, state, NoEvents())
                t_step = time.perf_counter() - t_step
            if log:
                log.mark(f"step{step}-end")
    finally:
        if log:
            log.stop()
        if prof:
            prof.stop()
    return job, t_step


def _worker(case_json: str, out: str, method: str) -> None:
    case = Case.from_json(case_json)
    result = measure_this_process(case, method, Path(out).parent)
    Path(out).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is written: end now, as tests/distributed/_worker.py does (torch's C++ teardown of a
    # process group has, rarely, aborted a finished process at interpreter shutdown).
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# Many ranks: real processes joined by a file:// rendezvous, each measuring itself.

def _tail(log: Path, chars: int = 4000) -> str:
    text = log.read_text(errors="replace")[-chars:] if log.exists() else ""
    return text or "(no output)"


def _c10_tail(workdir: Path, rank: int, lines: int = 40) -> str:
    """What a rank wrote to stderr while its c10 log had it (a rank killed in its steps), allocations left out."""
    log = workdir / f"c10-rank{rank}.log"
    if not log.exists():
        return ""
    kept = [ln for ln in log.read_text(errors="replace").splitlines()
            if "C10 " not in ln and "@@memory_measure" not in ln]
    return "\n(stderr during the recorded steps)\n" + "\n".join(kept[-lines:]) if kept else ""


def measure(case: Case, workdir: Path, timeout: float = 300.0, method: str = "c10-log") -> list[dict]:
    """One dict per rank: {"rank", "peak_bytes", "baseline_bytes", "step_peak_bytes", "seconds"}
    (and "end_bytes", "held_bytes", "step_seconds", "method", "threads").

    Starts `case.world` fresh processes (one for a single-process case) in `workdir`, joined by
    gloo through a file:// rendezvous there; each builds the job with gpudl's code and measures
    its own second training step. Kills them all on a timeout; a failure raises with each rank's output.
    """
    if case.device != "cpu":
        method = "allocator"  # the job's tensors are on the device: host-side observers do not see them
    if method not in METHODS:
        raise ValueError(f"method {method!r}: choose one of {', '.join(METHODS)}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    init = workdir / "rendezvous"
    init.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in JOB_ENV}
    threads = max(1, (os.cpu_count() or 1) // case.world)
    procs, logs, outs = [], [], []
    for rank in range(case.world):
        env = {**base, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        if case.world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(case.world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(case.world), **{INIT_ENV: f"file://{init}"})
        out, log = workdir / f"rank{rank}.json", workdir / f"rank{rank}.log"
        out.unlink(missing_ok=True)
        (workdir / f"c10-rank{rank}.log").unlink(missing_ok=True)
        args = [sys.executable, os.path.abspath(__file__), "--worker", case.to_json(), str(out), method]
        with open(log, "w") as f:
            procs.append(subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=workdir,
                                          start_new_session=True))
        logs.append(log)
        outs.append(out)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 5)  # let the others report their side, then stop them
        time.sleep(0.1)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    broke = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0 or not outs[r].exists()]
    if failed:
        detail = "\n".join(f"--- rank {r} (exit {procs[r].returncode}) ---\n{_tail(logs[r])}{_c10_tail(workdir, r)}"
                           for r in range(case.world))
        what = (f"ranks {broke} failed" + (f"; ranks {hung} were still running, killed" if hung else "") if broke
                else f"timed out after {timeout:g} s (ranks {hung} killed)" if hung else f"ranks {failed} wrote no result")
        raise RuntimeError(f"measuring {case.title}: {what}\n{detail}")
    return [json.loads(o.read_text()) for o in outs]


def _parse_value(raw: str) -> object:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed"))
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--strategy", default="single", choices=STRATEGIES)
    ap.add_argument("--world", type=int, default=None, help="processes (default: 1 for single, else 2)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a model setting (block_size=64) or a config key (data.image_size=32)")
    ap.add_argument("--method", default="c10-log", choices=METHODS)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (measured with the allocator's counters)")
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    world = a.world or (1 if a.strategy == "single" else 2)
    overrides = tuple((k.strip(), _parse_value(v.strip())) for k, _, v in (s.partition("=") for s in a.set))
    case = Case(a.model, a.batch_size, a.precision, a.ac, a.strategy, world, a.device, overrides)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpudl-memory-measure-") as tmp:
        ranks = measure(case, Path(tmp), a.timeout, a.method)
    took = time.perf_counter() - t0
    for r in ranks:
        print(f"{case.title} rank {r['rank']}: peak {r['peak_bytes'] / MiB:.2f} MiB, baseline "
              f"{r['baseline_bytes'] / MiB:.2f} MiB, step adds {r['step_peak_bytes'] / MiB:.2f} MiB "
              f"(held {r['held_bytes'] / MiB:.2f} MiB, end {r['end_bytes'] / MiB:.2f} MiB; {r['method']}; "
              f"rank {r['seconds']:.1f} s, case {took:.1f} s)")


if __name__ == "__main__":
    main()
