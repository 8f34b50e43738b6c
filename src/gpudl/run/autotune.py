"""`train.precision = "auto"` and `train.compile = "auto"` on a GPU: the job's own step timed, the fastest taken.

What makes a step fastest depends on the model and its batch as much as on the card: on an H200
gpt-tiny (0.84M parameters, batch 32) ran faster in fp32 than in bf16-mixed (5,093 against 3,284
samples/s: its steps are bound by kernel launches, and autocast adds casts), where GPT-2 124M ran
bf16-mixed at 6x fp32's speed (eager). So on CUDA, ROCm and XPU gpudl times a handful of the job's own
training steps (its model, batch shape, optimizer, clipping and guard, through `train_loop`) for each
candidate, on throw-away jobs built before the run's own, with the RNG restored after (the run's
initial weights and random draws are those of a run without the probe), and takes the fastest:

1. precision, eager: fp32 (IEEE; gpudl has no TF32 setting) against bf16-mixed (fp16-mixed where the
   device has no bf16; never fp8, which stays opt-in); the lower precision only where it is more than
   MARGIN faster, since fp32 is exact;
2. compile, at the chosen precision: eager, compiled (inductor's default) and, in one CUDA process
   without activation checkpointing, compiled with CUDA graphs ("reduce-overhead"); a more elaborate
   mode only where it is more than MARGIN faster than the simpler one taken so far.

Compiling takes seconds to minutes, so the compile probe is skipped where the whole run at the eager
step time is shorter than compiling would take (it could not win back what it spends), and no
candidate is started once it would run past CAP_S seconds of probing (the best measured so far wins).
The step times are cached per device, torch version, model, batch shape and layout (`autotune.json`
in the cache folder): the next run of the same job decides without probing. A setting given
explicitly is not probed. Other devices keep their rule: the CPU its precision by the measured
bf16/fp32 peak ratio and compile off (`precision.auto_policy`, `parallelize.compile_wanted`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..cache import cache_dir, read_json, write_json
from ..config import Config, TrainConfig
from ..device import synchronize
from ..distributed.parallelize import CUDA_GRAPHS, compile_wanted, cuda_graphs_blocker
from ..training.loop import Job, NoEvents, TrainState, train_loop
from ..training.micro import release
from ..training.precision import Precision, make_precision
from ..distributed.session import Session

PROBED_TYPES = ("cuda", "xpu")   # torch's device types of the GPUs probed (ROCm's is "cuda")
MARGIN = 0.05                    # a more elaborate candidate must be this much faster: step times on a GPU vary ~1-3%
CAP_S = 60.0                     # seconds of probing after which no candidate is started
# A first guess at one compile of a small model's step, until the probe has timed one: gpt-tiny's
# default run on an H200 took 22.9 s for 600 steps of 7.4 ms, compiled; start-up, evaluation and the
# compile shared the other 18 s (not timed apart).
COMPILE_COST_S = 15.0
ROUNDS, STEPS_PER_ROUND = 3, 3   # timed steps of a candidate, after its warm-up: the best round counts
MODES = {"eager": False, "compiled": True, CUDA_GRAPHS: CUDA_GRAPHS}  # candidate -> train.compile
CACHE_FILE = "autotune.json"

MakeJob = Callable[[Config, Precision], Job]              # a throw-away job of the run's model and first batch
Measure = Callable[[str, str], tuple[float, float]]       # (precision, mode) -> (s a step, s of warm-up)


def fastest(times: dict[str, float | str], order: list[str], margin: float = MARGIN) -> str | None:
    """The candidate to take from `times` (seconds a step; a string: why there is none): walking `order`
    from the simplest, a later candidate replaces the one taken only where it is more than `margin`
    faster, so a tie within noise keeps the simpler. None where no candidate has a time."""
    best = None
    for name in order:
        t = times.get(name)
        if isinstance(t, float) and (best is None or t < times[best] * (1 - margin)):
            best = name
    return best


def planned_steps(train: TrainConfig, step_s: float) -> int:
    """The steps this run will take at `step_s` a step: max_steps, or fewer where a time budget ends it."""
    if train.time_budget_s > 0:
        return max(1, min(train.max_steps, int(train.time_budget_s / step_s)))
    return train.max_steps


def compile_skip(steps: int, eager_s: float, candidates: int) -> str | None:
    """Why compiling is not worth trying (None: it may be): the most it can save is the whole run at the
    eager step time, and trying costs a compile per candidate (the run's own included)."""
    run_s, cost = steps * eager_s, candidates * COMPILE_COST_S
    if run_s < cost:
        return (f"the run, {steps} steps of {ms(eager_s)} eager (about {run_s:.0f} s), is shorter than compiling "
                f"would take (about {cost:.0f} s)")
    return None


def ms(seconds: float) -> str:
    t = seconds * 1e3
    return f"{t:.2f} ms" if t < 10 else f"{t:.1f} ms" if t < 1000 else f"{seconds:.2f} s"


@dataclass
class Probe:
    """Step times of (precision, mode) candidates: from the cache, else measured, one after another under
    the cap. Every rank runs the same candidates in step and takes rank 0's figures (`agree`)."""

    measure: Measure
    cached: dict[str, float | str] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter
    agree: Callable = lambda value: value
    cap_s: float = CAP_S
    spent: float = 0.0
    fresh: dict[str, float | str] = field(default_factory=dict)
    compile_s: float = COMPILE_COST_S   # what a compile took, once one was timed

    def time(self, precision: str, mode: str) -> float | str:
        label = f"{precision}|{mode}"
        if label in self.cached:
            return self.cached[label]
        expected = self.compile_s if mode != "eager" else 0.0
        if self.fresh and self.spent + expected > self.cap_s:  # the first candidate always runs
            result = f"not tried: the probe's {self.cap_s:.0f} s were spent"
        else:
            t0 = self.clock()
            result = self._measured(precision, mode)
            self.spent += self.agree(self.clock() - t0)
        self.fresh[label] = self.cached[label] = result
        return result

    @property
    def from_cache(self) -> bool:
        return not self.fresh

    def _measured(self, precision: str, mode: str) -> float | str:
        warm_s = None
        try:
            result, warm_s = self.measure(precision, mode)
        except Exception as e:  # noqa: BLE001 -- a candidate that fails (out of memory, a compile error) is excluded
            result = f"failed ({e if isinstance(e, CandidateFailed) else words(e)})"
        result, warm_s = self.agree([result, warm_s])  # rank 0's: every rank then skips the same candidates
        if mode != "eager" and warm_s is not None:  # its warm-up was mostly compiling: the next one's guess
            self.compile_s = max(1.0, warm_s)
        return result


def choose_precision(probe: Probe, candidates: list[str]) -> tuple[str, str]:
    """(precision, the start block's reason) from eager step times of `candidates` (fp32 first)."""
    times = {p: probe.time(p, "eager") for p in candidates}
    chosen = fastest(times, candidates) or candidates[0]
    return chosen, f"auto: {_against(chosen, times, possessive=True)}, {_how(probe)}"


def choose_compile(probe: Probe, precision: str, candidates: list[str], steps_for: Callable[[float], int]
                   ) -> tuple[str, str]:
    """(mode, the start block's reason): eager unless a compiled mode is more than MARGIN faster; compiled
    modes timed only where the run is long enough to win back their compiling."""
    eager = probe.time(precision, "eager")
    if not isinstance(eager, float):
        return "eager", f"auto: {precision} eager did not time ({eager})"
    if len(candidates) == 1:
        return "eager", "auto: torch.compile is not on by default here (on a GPU it needs Triton)"
    skip = compile_skip(steps_for(eager), eager, len(candidates) - 1)
    if skip is not None:
        return "eager", f"auto: {skip}"
    times = {m: probe.time(precision, m) for m in candidates}
    chosen = fastest(times, candidates) or "eager"
    graphs = "; CUDA graphs" if chosen == CUDA_GRAPHS else ""
    return chosen, f"auto: {_against(chosen, times, possessive=False)}{graphs}, {_how(probe)}"


def _against(chosen: str, times: dict[str, float | str], possessive: bool) -> str:
    """"1.42 ms a step against bf16-mixed's 2.01 ms" (possessive) or "0.61 ms a step against 1.42 ms eager":
    the chosen candidate's time, and every other's or why it has none."""
    others = []
    for name, t in times.items():
        if name == chosen:
            continue
        if not isinstance(t, float):
            others.append(f"{name} {t}")
            continue
        said = f"{name}'s {ms(t)}" if possessive else f"{ms(t)} {name}"
        others.append(said + (f" (less than {MARGIN:.0%} faster)" if t < times[chosen] else ""))
    return f"{ms(times[chosen])} a step" + (f" against {', '.join(others)}" if others else "")


def _how(probe: Probe) -> str:
    return "measured" if not probe.from_cache else "measured by an earlier run of this job, cached"


def compile_candidates(cfg: Config, session: Session) -> list[str]:
    """The modes worth timing for this job: eager; compiled where the device compiles by default; CUDA
    graphs where they can hold the step (one CUDA process, no activation checkpointing)."""
    device = session.device.type
    out = ["eager"]
    if compile_wanted("auto", device):
        out.append("compiled")
        if cuda_graphs_blocker(device, session.world, cfg.parallel, cfg.train.activation_checkpointing) is None:
            out.append(CUDA_GRAPHS)
    return out


def precision_candidates(session: Session) -> list[str]:
    info = session.device
    low = "bf16-mixed" if info.bf16 else "fp16-mixed" if info.fp16 else None
    return ["fp32"] + ([low] if low else [])


@dataclass
class Tuned:
    """What `tune` decided: the config with precision and compile as they will run, the precision, and
    the start block's compile line."""

    cfg: Config
    precision: Precision
    compile_note: str
    probed: bool = False   # decided here (measured, or from the cache), not by the device's rule or the user


def tune(cfg: Config, session: Session, precision: Precision, prepare: Callable[[], tuple[MakeJob, dict]],
         on_cpu: bool = False) -> Tuned:
    """Decide `train.precision` and `train.compile` where they are "auto" and the device is a GPU.

    `prepare()`, called only where something is probed: `make_job(cfg, precision)`, which builds a
    throw-away job of the run's model and first step's data at those settings, and what identifies the
    job for the cache (`job_identity`). `on_cpu` (internal, for tests: no config key reaches it): probe on
    the CPU too, whose rule is otherwise kept.
    """
    train, info = cfg.train, session.device
    want_p, want_c = train.precision == "auto", train.compile == "auto"
    if not (want_p or want_c) or (info.type not in PROBED_TYPES and not on_cpu):
        return Tuned(cfg, precision, compile_note(train.compile, info.type))
    make_job, job = prepare()
    key = cache_key(info, job)
    probe = Probe(_measure_with(cfg, session, make_job), cached=session.agree(_cached(key, session)),
                  agree=session.agree)
    with _rng_kept(info.torch_device):
        name, p_why = choose_precision(probe, precision_candidates(session)) if want_p else (precision.name, "")
        mode, c_why = choose_compile(probe, name, compile_candidates(cfg, session),
                                     lambda step_s: planned_steps(train, step_s)) if want_c else ("", "")
    if probe.fresh and session.is_writer:
        path = cache_dir() / CACHE_FILE
        kept = read_json(path)  # read again: another run may have written since
        write_json(path, {**kept, key: {**kept.get(key, {}), **probe.fresh}})
    chosen = make_precision(name, info) if want_p else precision
    chosen.reason = p_why or chosen.reason
    setting = MODES[mode] if want_c else train.compile
    cfg = replace(cfg, train=replace(train, precision=name if want_p else train.precision, compile=setting))
    return Tuned(cfg, chosen, f"{mode} ({c_why})" if want_c else compile_note(setting, info.type), probed=True)


def compile_note(setting: bool | str, device_type: str) -> str:
    """The start block's compile line where nothing was measured."""
    if setting == "auto":
        if compile_wanted("auto", device_type):
            return "compiled (auto: on for this device)"
        if device_type == "cpu":
            return "eager (auto: off on the CPU, where compiling takes longer than short runs gain)"
        return f"eager (auto: off on {device_type} devices)"
    name = {False: "eager", True: "compiled", CUDA_GRAPHS: f"{CUDA_GRAPHS}, CUDA graphs"}[setting]
    return f"{name} (asked for)"


def job_identity(model: dict, batch: list[torch.Tensor], cfg: Config, session: Session) -> dict:
    """What makes two jobs the same for the cache: the model, the step's tensors, the layout."""
    train = cfg.train
    return {"model": model, "batch": [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in batch],
            "layout": {"world": session.world, "dims": session.dims.describe() if session.dims else "one process",
                       "micro_batch": train.batch_size, "grad_accum": train.grad_accum,
                       "activation_checkpointing": train.activation_checkpointing, "attention": train.attention,
                       "fsdp_cpu_offload": cfg.parallel.fsdp_cpu_offload, "fused": cfg.optim.fused}}


def cache_key(info, job: dict) -> str:
    digest = hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return f"{info.kind}|{info.name}|torch={torch.__version__}|{digest}"


def _cached(key: str, session: Session) -> dict:
    return read_json(cache_dir() / CACHE_FILE).get(key, {}) if session.is_writer else {}


def _rng_kept(device: torch.device):
    """The RNG as it was, after the probe: the run draws what it would have drawn without it."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    return torch.random.fork_rng(devices=[index], device_type=device.type)


def words(e: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class CandidateFailed(RuntimeError):
    """A candidate that could not be timed, in words only: its exception's frames, and the job they hold,
    are gone before the next candidate needs the memory."""


class DidNotFit(RuntimeError):
    """The candidate ran out of memory at the job's micro-batch (the loop halved it)."""


def _measure_with(cfg: Config, session: Session, make_job: MakeJob) -> Measure:
    def measure(precision: str, mode: str) -> tuple[float, float]:
        trial = replace(cfg, train=replace(cfg.train, precision=precision, compile=MODES[mode]))
        job = failure = None
        try:
            job = make_job(trial, make_precision(precision, session.device))
            return time_steps(job, trial.train, warmup=3 if mode == CUDA_GRAPHS else 2)
        except Exception as e:  # noqa: BLE001 -- said by the probe; raised below, once the memory is free
            failure = CandidateFailed(words(e))
        finally:
            job = None
            gc.collect()
            if mode != "eager":
                torch.compiler.reset()  # the probe's compiled code and CUDA graphs go with its model
            release(session.device.torch_device)
        raise failure
    return measure


def time_steps(job: Job, train: TrainConfig, warmup: int) -> tuple[float, float]:
    """(seconds a step: the best of ROUNDS rounds of STEPS_PER_ROUND steps, the device synchronised
    around each round; seconds of the `warmup` steps before, where compilation happens)."""
    device, state = job.device, TrainState()
    base = replace(train, eval_every=0)

    def steps(n: int) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        train_loop(job, replace(base, max_steps=state.step + n), state, NoEvents())
        synchronize(device)
        return time.perf_counter() - t0

    warm_s = steps(warmup)
    best = min(steps(STEPS_PER_ROUND) for _ in range(ROUNDS)) / STEPS_PER_ROUND
    if state.micro_batch:
        raise DidNotFit(f"out of memory at micro-batch {train.batch_size}")
    return best, warm_s
