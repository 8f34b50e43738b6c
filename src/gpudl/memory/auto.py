"""`train.plan = "auto"` and `train.memory_limit`: a run's config made to fit, before anything is built.

Rank 0 plans (one training step traced per candidate, on fake tensors) for this machine: its
device's memory or `train.memory_limit`, the job's processes per node and nodes. The winner's
settings reach the other ranks as data (JSON), every rank applies the same ones, and the run's
config.toml records them with `train.plan = "off"`: a resumed or restarted run keeps the decision
instead of planning again.
"""

from __future__ import annotations

from rich.console import Console

from ..config import Config, with_sets
from ..config.sizes import parse_size
from ..errors import UserError
from ..distributed.session import Session
from .plan import MARGIN, Machine, Plan, local_machine, plan, training_state_bytes


def machine_here(cfg: Config, session: Session, speeds: bool = True) -> Machine:
    """The job's machine: this device (or `train.memory_limit`), the job's processes per node and nodes."""
    env = session.env
    nproc = env.local_world_size if env else 1
    limit = parse_size(cfg.train.memory_limit, "train.memory_limit") if cfg.train.memory_limit else None
    return local_machine(cfg.run.device, nproc, (env.world_size // nproc) if env else 1, limit, speeds)


def planned(cfg: Config, session: Session, console: Console) -> Config:
    """`cfg` with the plan's winner applied (unchanged unless `train.plan` is "auto")."""
    if cfg.train.plan != "auto":
        return cfg
    console.print("Planning memory: one training step per candidate, traced on fake tensors ...")
    answer = session.decided(lambda: _decide(plan(cfg, machine_here(cfg, session))))
    console.print(answer["said"], markup=False, soft_wrap=True)
    return with_sets(cfg, [*answer["sets"], "train.plan=off"])


def _decide(result: Plan) -> dict:
    from .report import why

    w = result.winner
    if w is None:
        raise UserError(f"train.plan=auto: {why(result)}")
    return {"sets": w.sets, "said": f"Plan: {w.describe()} · predicted peak {w.estimate.peak / 2**30:.2f} GiB per "
                                    f"process of {result.machine.usable / 2**30:.2f} GiB usable"}


def shard_wanted(cfg: Config, session: Session) -> bool:
    """Whether data-parallel degrees left "auto" shard (FSDP) or replicate (DDP): replicate when one
    replica's predicted peak, with the margin, fits in the memory here (rank 0 traces; all agree).
    A layout not estimated (several pipeline stages a rank with FSDP beside them) is judged by its weights,
    gradients and optimizer state alone (`state_needs_sharding`)."""
    p = cfg.parallel
    if session.world == 1 or "auto" not in (p.dp_replicate, p.dp_shard):
        return False
    return bool(session.decided(lambda: _replica_too_big(cfg, session)))


def _replica_too_big(cfg: Config, session: Session) -> bool:
    from .. import models
    from .estimate import dims_of
    from .fake_jobs import FakeJobs

    ddp = with_sets(cfg, [f"parallel.dp_replicate={dims_of(cfg, session.world).dp}", "parallel.dp_shard=1"])
    usable = machine_here(cfg, session, speeds=False).usable
    try:
        with FakeJobs(session.world) as jobs:
            return jobs.estimate(ddp).peak * (1 + MARGIN) > usable
    except UserError:
        from ..training.precision import param_dtype_of

        n = models.parameter_count(models.from_config(cfg))
        return state_needs_sharding(n, param_dtype_of(cfg.train.precision).itemsize, session, cfg)


def state_needs_sharding(n_params: int, param_bytes: int, session: Session, cfg: Config) -> bool:
    """For a module no trace can rebuild (a user's, in `fit`): shard when its weights, gradients and
    AdamW moments alone (weights x 2 + 8 bytes a parameter) would take over 40% of the memory here."""
    if session.world == 1 or "auto" not in (cfg.parallel.dp_replicate, cfg.parallel.dp_shard):
        return False
    return training_state_bytes(n_params, param_bytes) > 0.4 * machine_here(cfg, session, speeds=False).usable


def plan_module(module, loss_fn, example, cfg: Config, session: Session, console: Console) -> dict:
    """`fit(plan="auto")`: {"micro_batch", "checkpointing", "offload"} for a user's module: the largest
    halving of `cfg.train.batch_size` whose traced peak, with the margin, fits here; without
    checkpointing where one does (it costs a third more compute), else with it where the module has
    blocks to checkpoint; where neither fits on an accelerator, one process, the same with FSDP's CPU
    offload (FSDP over a group of one, traced here on a fake one). One process or DDP otherwise: a
    user's module cannot be sent to the worker that traces sharded layouts on a fake process group."""
    d = session.dims
    if d is not None and (d.dp_shard > 1 or d.tp > 1 or d.pp > 1):
        raise UserError(f"fit(plan='auto') plans one process or DDP, not {d.describe()}: drop plan='auto' and "
                        f"give batch_size (memory_limit= still recovers from running out), or use parallel=None")
    answer = session.decided(lambda: _fitting_micro_batch(module, loss_fn, example, cfg, session,
                                                          machine_here(cfg, session, speeds=False).usable))
    console.print(answer.pop("said"), markup=False, soft_wrap=True)
    return answer


def _fitting_micro_batch(module, loss_fn, example, cfg: Config, session: Session, usable: int) -> dict:
    from .plan import largest_fitting

    rows, step_rows = cfg.train.batch_size, cfg.train.batch_size * cfg.train.grad_accum
    sizes = [rows >> k for k in range(rows.bit_length()) if rows % (1 << k) == 0]

    def traced(m: int, ac: bool, offload: bool) -> tuple[int, int]:
        """(micro-batch, predicted peak on the device) of the module's step at micro-batch m."""
        sets = [f"train.batch_size={m}", f"train.grad_accum={step_rows // m}",
                f"train.activation_checkpointing={str(ac).lower()}", f"parallel.fsdp_cpu_offload={str(offload).lower()}"]
        return m, _module_peak(module, loss_fn, example, with_sets(cfg, sets), session)

    def fits(found: tuple[int, int]) -> bool:
        return found[1] * (1 + MARGIN) <= usable
    smallest, variants = None, [(False, False), (True, False)]  # (checkpointing, offload)
    if _may_offload(cfg, session):
        variants += [(False, True), (True, True)]
    for ac, offload in variants:
        try:
            (m, peak), _ = largest_fitting(sizes, lambda m: traced(m, ac, offload), fits)
        except UserError:
            continue  # checkpointing a module without blocks: not a candidate
        smallest = min(peak, smallest or peak)  # when none fits: the peak of a micro-batch of one
        if fits((m, peak)):
            how = " with activation checkpointing" * ac + " with FSDP's CPU offload" * offload
            return {"micro_batch": m, "checkpointing": ac, "offload": offload,
                    "said": f"Plan: micro-batch {m} x {step_rows // m}{how} · predicted peak "
                            f"{peak / 2**30:.3f} GiB per process of {usable / 2**30:.3f} GiB usable"}
    need = f"{smallest * (1 + MARGIN) / 2**30:.3f} GiB with the margin" if smallest else "more"
    raise UserError(f"fit(plan='auto'): no micro-batch of {type(module).__name__} fits in {usable / 2**30:.3f} GiB "
                    f"per process (a micro-batch of one needs {need}): give more memory_limit, use "
                    f"precision='bf16-mixed', or more processes")


def _may_offload(cfg: Config, session: Session) -> bool:
    """Whether FSDP's CPU offload is a candidate: one process with no group yet, on an accelerator."""
    import torch.distributed as dist

    from .offload import offloads_to_host

    return session.world == 1 and not dist.is_initialized() and \
        offloads_to_host(with_sets(cfg, ["parallel.fsdp_cpu_offload=true"]))


def _module_peak(module, loss_fn, example, cfg: Config, session: Session) -> int:
    """The device's predicted peak of the module's step; with CPU offload, as FSDP over one process on a
    fake group of one made for the trace (the run makes its own real one: `distributed/session.py`)."""
    from .offload import on_device
    from .trace import trace_module

    if not cfg.parallel.fsdp_cpu_offload:
        return on_device(trace_module(module, loss_fn, cfg, session, example, ddp=session.world > 1))
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..device import cpu_info
    from ..distributed.env import DistEnv
    from ..distributed.session import plan_parallel

    from ..data.loader import map_tensors

    # traced on the CPU's fake tensors, as the trace workers do: the batch's shapes and dtypes, not its device
    on_cpu = map_tensors(lambda t: t.to("cpu"), example)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        alone = plan_parallel(Session(cpu_info(), env=DistEnv(0, 1, 0, 1)), cfg.parallel)
        return on_device(trace_module(module, loss_fn, cfg, alone, on_cpu))
    finally:
        dist.destroy_process_group()
