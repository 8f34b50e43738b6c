"""Plans that fit: the layouts a job can take on a machine, each estimated (`estimate.py`), checked
against the memory there with a stated margin, and ranked by predicted step time.

The global batch the config asks for (batch_size x grad_accum x data-parallel processes) is kept:
a smaller micro-batch means more accumulation. For each layout (one process; DDP, FSDP, HSDP,
tensor parallelism over the processes) and activation checkpointing off and on, the largest
micro-batch that fits is found by bisection over the halvings (memory grows with the
micro-batch), so a layout costs a few traces, not one per micro-batch; with checkpointing, only
the micro-batches larger than the plain step's largest are searched (a smaller one would only
add recomputation to a step that already fits). Where none fits on an accelerator, FSDP with CPU
offload is planned the same way (`offloaded`). The fitting candidates are ranked by predicted
step time (`step_time.py`). Selective checkpointing is not a candidate: its cost is not predicted
(`docs/design.md`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from .. import models
from ..config import Config, with_sets
from ..device import DeviceInfo, detect
from ..device.specs import TARGETS, datasheet_tflops
from ..errors import UserError, unknown_name
from ..training.precision import param_dtype_of
from .depth import by_depth
from .estimate import Estimate
from .fake_jobs import FakeJobs
from .pipeline import pipeline_possible
from .step_time import flops_per_sample, step_seconds

T = TypeVar("T")
MARGIN = 0.10                 # of the predicted peak: allocator fragmentation, and what a trace does not see
RUNTIME_BYTES = 2**30         # per accelerator process, outside torch's tensors: context, NCCL and cuBLAS buffers
# cuBLAS's workspaces (32 MiB each on Hopper), one per thread that multiplies: the forward's and
# autograd's. The caching allocator holds them, so on an accelerator they count inside --memory-limit.
WORKSPACE_BYTES = 2 * 32 * 2**20
CPU_LINK_B_S = 5e9            # Gloo between processes of one machine


@dataclass(frozen=True)
class Machine:
    """The devices a plan is for: here (`local`) or one to rent (`target`)."""

    name: str
    device_type: str
    memory: int                     # per device, bytes
    peak_flops: dict[str, float]    # precision key (fp32, bf16, fp16) -> FLOP/s
    link_b_s: float                 # within a node, each way
    nproc: int = 1
    nnodes: int = 1
    limit: int | None = None        # --memory-limit: what the job's tensors may hold, per device
    host_b_s: float = 25e9          # between a device and host memory, each way (FSDP's CPU offload)
    host_memory: int | None = None  # of a node, where known (this machine's): what CPU offload may fill

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    @property
    def usable(self) -> int:
        """Bytes a rank's tensors may hold: the limit, else the memory less what the runtime keeps."""
        if self.limit is not None:
            return self.limit if self.device_type == "cpu" else self.limit - WORKSPACE_BYTES
        if self.device_type == "cpu":  # the processes of a node share its memory; the OS and the rest keep a tenth
            return int(self.memory * 0.9) // self.nproc
        return self.memory - RUNTIME_BYTES


def target_machine(target: str, nproc: int, nnodes: int = 1, limit: int | None = None) -> Machine:
    if target not in TARGETS:
        raise unknown_name("target GPU", target, TARGETS)
    t = TARGETS[target]
    peaks = {k: v * 1e12 for k, v in datasheet_tflops(t.device).items()}
    return Machine(f"{nproc * nnodes} x {t.name}", "cuda", int(t.memory_gib * 2**30), peaks, t.link_gb_s * 1e9,
                   nproc, nnodes, limit, t.host_gb_s * 1e9)


def local_machine(device: str = "auto", nproc: int = 1, nnodes: int = 1, limit: int | None = None,
                  speeds: bool = True) -> Machine:
    """This machine's device (`speeds=False`: its memory only, without measuring peak FLOP/s)."""
    from ..device.peak import measured_peak_flops

    info: DeviceInfo = detect(device)
    if not info.memory_bytes and limit is None:
        raise UserError(f"{info.label} does not report its memory: give --memory-limit")
    peaks = {p: measured_peak_flops(info, p) for p in info.precisions() if p != "tf32"} if speeds else {}
    link = CPU_LINK_B_S if info.type == "cpu" else 25e9  # a link's speed is not reported: PCIe-class unless told
    return Machine(f"{nproc * nnodes} x {info.label}", info.type, info.memory_bytes or limit, peaks, link, nproc,
                   nnodes, limit, host_memory=detect("cpu").memory_bytes)


@dataclass
class Candidate:
    """One way to run the job: its settings, and what the estimate says of it."""

    strategy: str
    settings: dict[str, object]             # config keys it sets
    activation_checkpointing: bool
    micro_batch: int
    grad_accum: int
    estimate: Estimate | None = None
    step_s: float | None = None
    rejected: str = ""                      # why it cannot run or does not fit ("" when it fits)
    traces: int = 0

    @property
    def fits(self) -> bool:
        return self.estimate is not None and not self.rejected

    @property
    def sets(self) -> list[str]:
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings.items()]

    def describe(self) -> str:
        ac = " · checkpointing" if self.activation_checkpointing else ""
        return f"{self.strategy}{ac} · micro-batch {self.micro_batch} x {self.grad_accum}"


@dataclass
class Plan:
    """What `gpudl.plan` found: every candidate layout of the job on the machine (each with its traced
    `estimate` and, where it does not fit, why), and the `winner`: the fastest that fits (None: none)."""

    machine: Machine
    global_batch: int
    cfg: Config                             # the job as planned (precision and kernel as they will be there)
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def winner(self) -> Candidate | None:
        fitting = [c for c in self.candidates if c.fits]
        return min(fitting, key=lambda c: (c.step_s, -c.micro_batch)) if fitting else None


def plan(cfg: Config, machine: Machine) -> Plan:
    """Every layout of `cfg`'s job on `machine` (or the one its parallel section fixes), the largest
    micro-batch of each that fits, and their step times."""
    cfg = _for_machine(cfg, machine)
    _check_request(cfg, machine)
    result = Plan(machine, global_batch(cfg, machine.world), cfg)
    options = _fixed_layout(cfg, machine) or layouts(cfg, machine)
    # Layouts are planned side by side, each in a thread whose traces run in a worker process of its
    # own (`fake_jobs.py`); a one-process job is traced here, where only one trace may run at a time.
    # Workers start at the first trace the cache does not hold (`trace_cache.py`): a question asked
    # before costs no worker at all.
    with FakeJobs(machine.world) as traces, ThreadPoolExecutor(len(options) if machine.world > 1 else 1) as pool:
        # FLOPs are counted with torch's FLOP counter, whose module hooks are global: not while a
        # one-process job is traced in this process's pool, but while a sharded job's workers start.
        flops = by_depth(cfg, flops_per_sample) if machine.world == 1 else None
        result.candidates = _side_by_side(pool, traces, cfg, machine, options, result.global_batch)
        if not any(c.fits for c in result.candidates):  # then, and only then, pay for the host's memory
            result.candidates += _side_by_side(pool, traces, cfg, machine, offloaded(cfg, machine, options),
                                               result.global_batch)
        flops = flops or by_depth(cfg, flops_per_sample)
    for c in result.candidates:
        if c.fits:
            c.step_s = step_seconds(c, cfg, machine, flops, result.global_batch)
    return result


def _side_by_side(pool: ThreadPoolExecutor, traces: FakeJobs, cfg: Config, machine: Machine,
                  options: list[tuple[str, dict]], batch: int) -> list[Candidate]:
    """Each layout's candidates, in order: refused untraced where its weights cannot be made whole
    (`_made_whole`), else planned in the pool, the layouts side by side."""
    work = [_made_whole(cfg, machine, strategy, parallel)
            or pool.submit(_layout_candidates, cfg, machine, traces, strategy, parallel, batch)
            for strategy, parallel in options]
    return [c for w in work for c in ([w] if isinstance(w, Candidate) else w.result())]


def _layout_candidates(cfg: Config, machine: Machine, traces: FakeJobs, strategy: str, parallel: dict,
                       batch: int) -> list[Candidate]:
    """The layout's largest micro-batch that fits, without checkpointing and, where that could buy a
    larger one, with it (it runs the blocks' forward again: otherwise not worth a trace)."""
    plain = _largest_that_fits(cfg, machine, traces, strategy, parallel, False, batch)
    if plain.fits and plain.grad_accum <= _least_accumulation(cfg, parallel, machine, batch):
        return [plain]
    # Checkpointing only ever earns its recomputation with a larger micro-batch than the plain step's:
    # smaller ones are not traced (they hold less than the plain step that fits at its size).
    above = plain.micro_batch if plain.fits else 0
    checkpointed = _largest_that_fits(cfg, machine, traces, strategy, parallel, True, batch, above)
    return [plain] + ([checkpointed] if checkpointed else [])


def _made_whole(cfg: Config, machine: Machine, strategy: str, parallel: dict) -> Candidate | None:
    """The layout refused, untraced, where the model's weights, made whole on each device before FSDP
    shards or offloads them (`parallelize`), do not fit there; None where they do (a pipeline makes
    only its rank's stages)."""
    if int(parallel.get("parallel.pp", 1)) > 1:
        return None
    whole = models.parameter_count(models.from_config(cfg)) * \
        param_dtype_of(cfg.train.precision).itemsize
    if whole * (1 + MARGIN) <= machine.usable:
        return None
    return Candidate(strategy, parallel, False, 0, 0,
                     rejected=f"its weights, made whole on each device before sharding, need {whole / 2**30:.2f} GiB")


def _least_accumulation(cfg: Config, parallel: dict, machine: Machine, batch: int) -> int:
    from .estimate import dims_of

    return 1 if batch % dims_of(_apply(cfg, parallel), machine.world).dp == 0 else 0


def offloaded(cfg: Config, machine: Machine, options: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The layouts to try when none fits on the devices alone: with FSDP's CPU offload, which keeps the
    weights, gradients and optimizer state in host memory and runs the update there (its copies and
    update are in the step time). The config's own layout, else FSDP over every process (over one:
    FSDP on a group of one). None on the CPU, whose host memory is the device's."""
    if machine.device_type == "cpu" or cfg.parallel.fsdp_cpu_offload:
        return []
    if _fixed_layout(cfg, machine):
        return [(f"{strategy} · CPU offload", {**p, "parallel.fsdp_cpu_offload": True}) for strategy, p in options]
    w = machine.world
    return [(f"{'FSDP' if w > 1 else 'one process'} · CPU offload",
             {"parallel.tp": 1, "parallel.pp": 1, "parallel.dp_replicate": 1, "parallel.dp_shard": w,
              "parallel.fsdp_cpu_offload": True})]


def _check_request(cfg: Config, machine: Machine) -> None:
    """What no plan can fix, said in one line before any trace: a layout the model cannot take, or a
    memory below what the parameters need at the most sharding: their weights, gradients and optimizer
    state on the CPU; on an accelerator, where CPU offload keeps those in host memory, the largest
    FSDP unit's weights gathered in the compute dtype."""
    from ..distributed.parallelize import block_units
    from ..distributed.preflight import check_job

    check_job(cfg, machine.world, cfg.train.precision)
    model = models.build_meta(models.from_config(cfg))
    n = sum(p.numel() for p in model.parameters())
    if machine.device_type == "cpu":
        least = training_state_bytes(n, param_dtype_of(cfg.train.precision).itemsize) // machine.world
        what = (f"{n / 1e6:.0f}M parameters, their gradients and AdamW state take {least / 2**30:.2f} GiB per "
                f"device even sharded over {machine.world}: use more devices or more memory")
    else:
        units = block_units(model)
        in_units = {id(p) for u in units for p in u.parameters()}
        sizes = [sum(p.numel() for p in u.parameters()) for u in units]
        sizes.append(sum(p.numel() for p in model.parameters() if id(p) not in in_units))  # the root's own
        least = max(sizes) * (4 if cfg.train.precision == "fp32" else 2)
        what = (f"even with FSDP's CPU offload the largest unit's weights take {least / 2**30:.2f} GiB on the "
                f"device: use more memory")
    if least > machine.usable:
        raise UserError(f"{machine.usable / 2**30:.2f} GiB per device is less than the parameters alone need: {what}")


def training_state_bytes(n_params: int, param_bytes: int) -> int:
    """What training holds whatever the batch: the weights, their gradients and AdamW's two fp32 moments."""
    return n_params * (2 * param_bytes + 8)


def _fixed_layout(cfg: Config, machine: Machine) -> list[tuple[str, dict[str, object]]]:
    """The config's own layout, when its parallel section sets one; else none (every layout is planned)."""
    from .estimate import strategy_of

    p = cfg.parallel
    if machine.world == 1 or all(v in (1, "auto") for v in (p.dp_replicate, p.dp_shard, p.tp, p.pp)):
        return []
    return [(strategy_of(cfg, machine.world), {"parallel.dp_replicate": p.dp_replicate,
                                                 "parallel.dp_shard": p.dp_shard, "parallel.tp": p.tp,
                                                 "parallel.pp": p.pp})]


def global_batch(cfg: Config, world: int) -> int:
    from .estimate import dims_of

    return cfg.train.batch_size * cfg.train.grad_accum * dims_of(cfg, world).dp


def _for_machine(cfg: Config, machine: Machine) -> Config:
    """The precision and attention kernel the job will have there (a trace runs on this CPU's fake tensors)."""
    precision = cfg.train.precision
    if precision == "auto" and machine.device_type != "cpu":
        precision = "bf16-mixed" if "bf16" in machine.peak_flops else "fp16-mixed" if "fp16" in machine.peak_flops \
            else "fp32"
    elif precision == "auto":
        from ..training.precision import make_precision

        precision = make_precision("auto", detect("cpu")).name
    attention = cfg.train.attention if machine.device_type == "cpu" else "sdpa"  # accelerators keep SDPA's choice
    train = dataclasses.replace(cfg.train, precision=precision, attention=attention, compile=False)
    # the device type: where FSDP's CPU offload keeps its shards depends on it (trace.offloads_to_host)
    return dataclasses.replace(cfg, train=train, run=dataclasses.replace(cfg.run, device=machine.device_type))


def layouts(cfg: Config, machine: Machine) -> list[tuple[str, dict[str, object]]]:
    """(name, parallel settings) of each way to spread the job over the machine's processes."""
    w, n = machine.world, machine.nproc
    if w == 1:
        return [("one process", {})]
    flat = {"parallel.tp": 1, "parallel.pp": 1}
    out = [("DDP", {**flat, "parallel.dp_replicate": w, "parallel.dp_shard": 1}),
           ("FSDP", {**flat, "parallel.dp_replicate": 1, "parallel.dp_shard": w})]
    if machine.nnodes > 1:
        out.append(("HSDP", {**flat, "parallel.dp_replicate": machine.nnodes, "parallel.dp_shard": n}))
    for t in (2, 4, 8):
        if t <= n and n % t == 0 and _tp_possible(cfg, t):
            rest = w // t
            out.append((f"TP {t}" + (f" x FSDP {rest}" if rest > 1 else ""),
                        {"parallel.pp": 1, "parallel.tp": t, "parallel.dp_replicate": 1, "parallel.dp_shard": rest}))
    # A pipeline over every process, or over some with FSDP beside it; the micro-batches
    # `_largest_that_fits` tries are those its schedule can split.
    for p in sorted({2, 4, 8, w}):
        if p <= w and w % p == 0 and pipeline_possible(cfg, p):
            out.append((f"PP {p}" + (f" x FSDP {w // p}" if p < w else ""),
                        {"parallel.tp": 1, "parallel.pp": p, "parallel.dp_replicate": 1, "parallel.dp_shard": w // p}))
    return out


def _tp_possible(cfg: Config, tp: int) -> bool:
    from ..distributed.tensor import check_tp

    try:
        check_tp(models.build_meta(models.from_config(cfg)), tp, False)
    except UserError:
        return False
    return True


def _apply(cfg: Config, settings: dict[str, object]) -> Config:
    return with_sets(cfg, [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()])


def _largest_that_fits(cfg: Config, machine: Machine, traces: FakeJobs, strategy: str, parallel: dict,
                       ac: bool, batch: int, above: int = 0) -> Candidate | None:
    """The largest micro-batch (halving from batch / dp, larger than `above`) of this layout that fits,
    by bisection; None when no micro-batch the layout can take is larger than `above`."""
    from .estimate import dims_of

    dp = dims_of(_apply(cfg, parallel), machine.world).dp
    if batch % dp:
        return Candidate(strategy, parallel, ac, 0, 0, rejected=f"the global batch {batch} does not split over "
                                                                  f"{dp} data-parallel processes")
    sizes = [batch // dp // 2**k for k in range(int(math.log2(batch // dp)) + 1)
             if (batch // dp) % 2**k == 0 and batch // dp // 2**k > above]
    pp = int(parallel.get("parallel.pp", 1))
    if pp > 1:
        sizes = [b for b in sizes if pipeline_possible(_apply(cfg, parallel), pp, b)]
    if not sizes and above:
        return None
    if not sizes:
        return Candidate(strategy, parallel, ac, 0, 0, rejected=f"no micro-batch of the global batch {batch} "
                                                                  f"splits into the schedule's micro-batches")
    def attempt(b: int) -> Candidate:
        settings = {**parallel, "train.activation_checkpointing": ac, "train.batch_size": b,
                    "train.grad_accum": batch // dp // b}
        c = Candidate(strategy, settings, ac, b, batch // dp // b)
        c.estimate = traces.estimate(_apply(cfg, settings))
        need = int(c.estimate.peak * (1 + MARGIN))
        host_need = int(c.estimate.host * machine.nproc * (1 + MARGIN))  # CPU offload: every process of a node
        if need > machine.usable:
            c.rejected = f"needs {need / 2**30:.2f} GiB"  # with the margin; the table's title gives what is usable
        elif machine.host_memory and host_need > machine.host_memory * 0.9:  # the OS and the rest keep a tenth
            c.rejected = f"needs {host_need / 2**30:.2f} GiB of host memory of {machine.host_memory / 2**30:.0f}"
        return c
    best, tried = largest_fitting(sizes, attempt, lambda c: not c.rejected)
    best.traces = tried
    return best


def largest_fitting(sizes: list[int], attempt: Callable[[int], T], fits: Callable[[T], bool]) -> tuple[T, int]:
    """The attempt of the largest of `sizes` (descending) that fits, by bisection (memory grows with
    the micro-batch), or that of the smallest when none does; and how many attempts it took.
    Shared by the recipes' planner and `fit(plan="auto")`'s."""
    tried: dict[int, T] = {}

    def at(i: int) -> T:
        if i not in tried:
            tried[i] = attempt(sizes[i])
        return tried[i]
    lo, hi = 0, len(sizes) - 1  # find the first index that fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(at(mid)):
            hi = mid
        else:
            lo = mid + 1
    return at(lo), len(tried)
