"""What each rank of a distributed test runs (imported by _worker.py in every process).

Each body takes the device its rank trains on ("cpu", or an accelerator type such as "cuda", as
helper.run_ranks passes it); a test also calls a body in its own process, as the one-process reference.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from rich.console import Console
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

# A GPT small enough for many processes on two cores, trained in fp32 so sums can be compared.
TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.block_size=32", "train.batch_size=4",
        "train.max_steps=10", "train.log_every=1", "train.eval_every=5", "train.eval_batches=2",
        "train.precision=fp32", "sample.tokens=0", "log.progress=false", "log.plot=false", "optim.warmup_steps=2",
        "train.time_budget_s=0",
        # On the CPU unless a test says otherwise (a body's `device`, `--device`); eager, as the
        # one-process references are (compile's "auto" turns it on for GPUs).
        "run.device=cpu", "train.compile=false"]


def on(device: str, sets: list[str]) -> list[str]:
    """The settings of a run on `device`: TINY's, the device, then the test's own."""
    return [*TINY, f"run.device={device}", *sets]


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as one whole tensor on rank 0 (sharded ones gathered); {} elsewhere."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train_tiny(sets: list[str], resume: str | None = None, device: str = "cpu") -> dict:
    from gpudl.config import load_config
    from gpudl.run.recipe import train

    cfg = load_config(None, on(device, sets))
    result = train(cfg, resume=resume, console=Console(quiet=True))
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "evals": [r for r in result.records if r["kind"] == "eval"],
            "params": full_params(result.model), "summary": result.summary, "rank": dist.get_rank(),
            "shards_on": sorted({p.to_local().device.type for p in result.model.parameters() if hasattr(p, "to_local")})}


def train_images(sets: list[str], resume: str | None = None, device: str = "cpu") -> dict:
    """Train a CNN with exactly `sets` (no TINY: its settings are a GPT's) and report the losses."""
    from gpudl.config import load_config
    from gpudl.run.recipe import train

    result = train(load_config(None, [f"run.device={device}", *sets]), resume=resume, console=Console(quiet=True))
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "rank": _rank_or_0()}


def train_with_stall(sets: list[str], stall_rank: int, stall_step: int, seconds: float, device: str = "cpu") -> dict:
    """Train, but on `stall_rank` hang for `seconds` in the forward pass of step `stall_step`."""
    import time

    from gpudl import models

    real = models.loss_for
    calls = {"n": 0}

    def stalling(spec):
        loss = real(spec)

        def fn(model, batch):
            calls["n"] += batch[0].device.type != "meta"  # FLOP counting runs once on the meta device
            if dist.get_rank() == stall_rank and calls["n"] == stall_step:
                time.sleep(seconds)
            return loss(model, batch)
        return fn

    models.loss_for = stalling
    return train_tiny(sets, device=device)


def train_gathered(sets: list[str], resume: str | None = None, device: str = "cpu") -> dict:
    """Train; every rank's parameters merged by name, on every rank (for layouts whose ranks hold
    different parameters: pipeline stages)."""
    from torch.distributed.tensor import DTensor

    from gpudl.config import load_config
    from gpudl.run.recipe import train

    result = train(load_config(None, on(device, sets)), resume=resume, console=Console(quiet=True))
    mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in result.model.state_dict().items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "evals": [r for r in result.records if r["kind"] == "eval"],
            "params": {k: v for part in parts for k, v in part.items()}, "summary": result.summary,
            "rank": dist.get_rank()}


def train_tiny_tp(sets: list[str], device: str = "cpu") -> dict:
    """train_tiny, and how the trained tensor-parallel model is laid out: each DTensor parameter's
    placements, local shape and mesh dimensions, and the local shape of what the first block's
    first norm returns."""
    from torch.distributed.tensor import DTensor

    from gpudl.config import load_config
    from gpudl.run.recipe import train

    result = train(load_config(None, on(device, sets)), console=Console(quiet=True))
    model = result.model
    # Read before the forward below: FSDP leaves the last block's and the root's parameters gathered after one.
    params = full_params(model)
    layout = {n: (str(p.placements), tuple(p.to_local().shape), p.device_mesh.mesh_dim_names)
              if isinstance(p, DTensor) else ("plain", tuple(p.shape), ()) for n, p in model.named_parameters()}
    seen = []
    hook = model.blocks["0"].norm1.register_forward_hook(
        lambda m, args, out: seen.append(tuple((out.to_local() if isinstance(out, DTensor) else out).shape)))
    with torch.no_grad():
        model(torch.zeros(2, model.cfg.block_size, dtype=torch.long, device=model.wpe.weight.device))
    hook.remove()
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "params": params, "layout": layout, "norm_out": seen[0],
            "tied": model.wte.weight is model.lm_head.weight, "rank": dist.get_rank()}


def poison_loss(rank_to_poison: int | None, step: int, factor: float = float("nan")) -> None:
    """Multiply the loss by `factor` (NaN: make it NaN) at training step `step` on one rank (None: in this
    single process)."""
    from gpudl import models

    real = models.loss_for
    calls = {"n": 0}

    def poisoned(spec):
        loss = real(spec)

        def fn(model, batch):
            calls["n"] += batch[0].device.type != "meta"
            me = dist.get_rank() if dist.is_initialized() else None
            out = loss(model, batch)
            return out * factor if calls["n"] == step and me == rank_to_poison else out
        return fn

    models.loss_for = poisoned


def train_poisoned(sets: list[str], rank: int, step: int, device: str = "cpu", factor: float = float("nan")) -> dict:
    poison_loss(rank, step, factor)
    return train_tiny(sets, device=device)


def user_model_and_data(seed: int = 0):
    """A user's own module and tensors, as the README's fit example has them."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(512, 8, generator=g), torch.randint(0, 3, (512,), generator=g)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 3))
    return net, (x, y)


def fit_user_model(batch_size: int, parallel: dict | None = None, device: str = "cpu") -> dict:
    import torch.nn.functional as F

    import gpudl
    from gpudl.config import ParallelConfig

    net, data = user_model_and_data()
    result = gpudl.fit(net, data, loss=F.cross_entropy, max_steps=8, batch_size=batch_size, lr=1e-2, device=device,
                       precision="fp32", log_every=1, quiet=True, parallel=ParallelConfig(**(parallel or {})))
    return {"losses": [r["loss"] for r in result.records if r["kind"] == "train"],
            "params": full_params(result.model)}


class WideBlocks(torch.nn.Module):
    """A user's module with blocks (FSDP's units), wide enough that its weights are hundreds of MiB."""

    def __init__(self, width: int = 2048, depth: int = 4):
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.out = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + torch.nn.functional.gelu(block(x))
        return self.out(x)


def fit_planned_under_its_training_state(device: str = "cpu") -> dict:
    """fit(plan="auto") of WideBlocks under a memory limit below its weights, gradients and AdamW
    moments (12 of their 16 bytes a parameter, plus cuBLAS's workspaces): what the plan chose and ran."""
    import torch.nn.functional as F

    import gpudl
    from gpudl.memory.plan import WORKSPACE_BYTES

    _, data = user_model_and_data()

    def run(**kw):
        torch.manual_seed(0)
        return gpudl.fit(WideBlocks(), data, loss=F.cross_entropy, max_steps=6, batch_size=64, lr=1e-4, device=device,
                         precision="fp32", log_every=1, quiet=True, compile=False, **kw)
    limit = WORKSPACE_BYTES + 12 * sum(p.numel() for p in WideBlocks().parameters())
    result = run(plan="auto", memory_limit=limit)
    plain = run()  # no limit: on the device alone, the same samples each step
    return {"losses": [r["loss"] for r in result.records if r["kind"] == "train"],
            "plain_losses": [r["loss"] for r in plain.records if r["kind"] == "train"],
            "ooms": [r for r in result.records if r["kind"] == "oom"],
            "shards_on": sorted({p.to_local().device.type for p in result.model.parameters() if hasattr(p, "to_local")})}


def hf_gpt2_and_data(seed: int = 0):
    """A Hugging Face GPT-2 (random init, no dropout, so runs compare) and counting sequences as a
    dict of columns: each sample is {"input_ids", "labels"}, as a Hugging Face pipeline gives it."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=16, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, 16, (256, 1), generator=g) + torch.arange(16)) % 16
    return model, {"input_ids": ids, "labels": ids}


def fit_hf_gpt2(batch_size: int, parallel: dict | None = None, data: str = "columns", device: str = "cpu") -> dict:
    """fit on the dict of columns (batch_size samples per rank), or on a DataLoader over the same
    samples in order (its batch size per rank; on several ranks each takes every other batch)."""
    from torch.utils.data import DataLoader

    import gpudl
    from gpudl.config import ParallelConfig

    model, columns = hf_gpt2_and_data()
    if data == "dataloader":
        samples = [{"input_ids": row, "labels": row} for row in columns["input_ids"]]
        columns = DataLoader(samples, batch_size=batch_size)
    result = gpudl.fit(model, columns, max_steps=8, batch_size=batch_size, lr=3e-3, precision="fp32", log_every=1,
                       quiet=True, parallel=ParallelConfig(**(parallel or {})), device=device)
    return {"losses": [r["loss"] for r in result.records if r["kind"] == "train"],
            "params": full_params(result.model), "mfu": result.metrics.mfu}


class RunsOutOfMemory(torch.nn.Module):
    """A user's module that runs out of memory, from its `at`-th training forward on, for micro-batches of
    more than `rows` samples: in its forward, or in the backward of its output (`where`)."""

    def __init__(self, net: torch.nn.Module, at: int, rows: int, where: str = "forward"):
        super().__init__()
        self.net, self.at, self.rows, self.where, self.calls = net, at, rows, where, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += torch.is_grad_enabled()
        too_big = self.calls >= self.at and x.shape[0] > self.rows
        if too_big and self.where == "forward":
            raise torch.OutOfMemoryError(f"injected: a micro-batch of {x.shape[0]} rows does not fit")
        y = self.net(x)
        if too_big and y.requires_grad:
            y.register_hook(lambda grad: _out_of_memory(x.shape[0]))
        return y


def _out_of_memory(rows: int) -> None:
    raise torch.OutOfMemoryError(f"injected in backward: a micro-batch of {rows} rows does not fit")


def fit_out_of_memory(batch_size: int, grad_accum: int = 1, at: int = 0, rows: int = 0, where: str = "forward",
                      parallel: dict | None = None, device: str = "cpu") -> dict:
    """fit of the user model, running out of memory as `RunsOutOfMemory` says (at=0: never)."""
    import torch.nn.functional as F

    import gpudl
    from gpudl.config import ParallelConfig

    net, data = user_model_and_data()
    model = RunsOutOfMemory(net, at, rows, where) if at else net
    result = gpudl.fit(model, data, loss=F.cross_entropy, max_steps=8, batch_size=batch_size, grad_accum=grad_accum,
                       lr=1e-2, precision="fp32", log_every=1, quiet=True, parallel=ParallelConfig(**(parallel or {})),
                       device=device)
    return {"losses": [r["loss"] for r in result.records if r["kind"] == "train"],
            "ooms": [r for r in result.records if r["kind"] == "oom"]}


def fit_resumable(run_dir: str, model: str = "user", data: str = "tensors", resume: bool = False, max_steps: int = 9,
                  checkpoint_every: int = 3, parallel: dict | None = None, device: str = "cpu") -> dict:
    """fit of the user module or the Hugging Face GPT-2, into `run_dir` with checkpoints (or resumed from it),
    with validation data: its losses, evaluations and final weights on rank 0. `data`: the tensors (a dict of
    columns for GPT-2), or a DataLoader over them that shuffles with a generator of its own."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import gpudl
    from gpudl.config import ParallelConfig

    if model == "user":
        net, (x, y) = user_model_and_data()
        train, val, kw = (x[:384], y[:384]), (x[384:], y[384:]), {"loss": F.cross_entropy, "lr": 1e-2}
        if data == "dataloader":
            train = DataLoader(TensorDataset(*train), batch_size=16, shuffle=True,
                               generator=torch.Generator().manual_seed(5))
    else:
        net, columns = hf_gpt2_and_data()
        train = {k: v[:192] for k, v in columns.items()}
        val, kw = {k: v[192:] for k, v in columns.items()}, {"lr": 3e-3}
    result = gpudl.fit(net, train, val_data=val, max_steps=max_steps, batch_size=16, precision="fp32", log_every=1,
                       eval_every=4, quiet=True, checkpoint_every=checkpoint_every, device=device,
                       parallel=ParallelConfig(**(parallel or {})), **({"resume": run_dir} if resume else
                                                                       {"run_dir": run_dir}), **kw)
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "evals": [r for r in result.records if r["kind"] == "eval"],
            "params": full_params(result.model), "steps": result.metrics.steps}


def _rank_or_0() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole model's parameters and optimizer state, gathered to rank 0 (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"params": full_params(model), "optim": get_optimizer_state_dict(model, optimizer, options=options)}
    # copies: tensors already on the CPU come back as the live ones, which training goes on changing
    return torch.utils._pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)


def load_weights_only(sets: list[str], run: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The newest checkpoint of `run`, weights only (optimizer=None), loaded into a fresh job of this
    layout (DDP's replicas, FSDP's shards); the whole weights on rank 0."""
    from pathlib import Path

    from gpudl.checkpoint import Checkpointer, model_fingerprint
    from gpudl.config import load_config
    from gpudl.training.job import model_and_data
    from gpudl.training.precision import make_precision
    from gpudl.run.recipe import recipe_job
    from gpudl.distributed.session import plan_parallel, start_session

    cfg = load_config(None, on(device, sets))
    session = start_session(cfg.run, Console(quiet=True), cfg.parallel.timeout_s)
    plan_parallel(session, cfg.parallel)
    spec, data = model_and_data(cfg, *session.dp)
    job, _ = recipe_job(cfg, spec, data, session, make_precision(cfg.train.precision, session.device))
    ckpt = Checkpointer(Path(run) / "checkpoints", cfg.checkpoint.keep, model_fingerprint(spec.name, spec.config),
                        is_writer=session.is_writer)
    ckpt.load(ckpt.latest(), job.model, optimizer=None)
    return full_params(job.model)


def resume_on_this_world(sets: list[str], resume: str | None = None, weights_only: bool = False,
                         device: str = "cpu") -> dict:
    """Train (resuming `resume`, saved by any number of processes) and report: the losses; the whole
    state at the end; the whole state and this rank's CPU RNG state right after the restore; with
    `weights_only`, first a weights-only load of the same checkpoint into a fresh job. Also called
    in the test's own process (one process, no group)."""
    from gpudl.config import load_config
    from gpudl.run import recipe

    out = {"weights_only": load_weights_only(sets, resume, device)} if weights_only else {}
    real = recipe.restore_job

    def restore_and_look(ckpt, job, *args):
        restored = real(ckpt, job, *args)
        out["rng"] = torch.get_rng_state()  # read before the state gather below, which draws nothing anyway
        out["restored"] = _full_state(job.model, job.optimizer)
        return restored

    recipe.restore_job = restore_and_look
    printed = io.StringIO()
    try:
        result = recipe.train(load_config(None, on(device, sets)), resume=resume,
                              console=Console(file=printed, width=400))
    finally:
        recipe.restore_job = real
    return {**out, **_full_state(result.model, result.optimizer), "rank": _rank_or_0(), "printed": printed.getvalue(),
            "losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"}}


def resume_with_a_late_rank(sets: list[str], resume: str, late_rank: int, seconds: float,
                            device: str = "cpu") -> dict:
    """Resume, but on `late_rank` sleep for `seconds` before the checkpoint load's DCP read (as a rank held
    up by a slow file system, or one that skipped the load, looks to the others)."""
    import time

    from gpudl.checkpoint import store

    real = store._dcp_load

    def late(*args, **kwargs):
        if dist.get_rank() == late_rank:
            time.sleep(seconds)
        return real(*args, **kwargs)

    store._dcp_load = late
    return train_tiny(sets, resume=resume, device=device)


def join_late(sets: list[str], late_rank: int, seconds: float, device: str = "cpu") -> dict:
    """Train, joining the job through gpudl's rendezvous, but `seconds` late on `late_rank`."""
    import os
    import time

    if int(os.environ["RANK"]) == late_rank:
        time.sleep(seconds)
    return train_tiny(sets, device=device)



def train_fp8_emulated(sets: list[str], resume: str | None = None, device: str = "cpu") -> dict:
    """train_tiny at precision fp8 without fp8 tensor cores (torchao's emulated float8 matmuls), every
    linear but the head made float8 (the tiny model's are below torchao's size thresholds); and what
    FSDP2's float8 all-gather left: which weights are float8-cast ones, which have a precomputed scale."""
    import functools

    import gpudl.distributed.float8 as float8
    import gpudl.run.recipe as recipe
    import gpudl.run.stages as stages
    from gpudl.checkpoint.store import local_data
    from gpudl.config import load_config
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    stages.make_precision = functools.partial(stages.make_precision, emulate_fp8=True)  # where open_run makes it
    float8.worth_float8 = lambda out_features, in_features, name: True
    result = recipe.train(load_config(None, on(device, sets)), resume=resume, console=Console(quiet=True))
    weights = {n: m.weight for n, m in result.model.named_modules() if isinstance(m, Float8Linear)}
    local = {n: w._local_tensor if isinstance(w, DTensor) else w for n, w in weights.items()}  # to_local() is a view
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "params": {k: local_data(v).detach().clone() for k, v in full_params(result.model).items()},
            "rank": _rank_or_0(), "float8": sorted(weights),
            "sharded": sorted(n for n, w in weights.items() if isinstance(w, DTensor)),
            "cast_in_fp8": sorted(n for n, w in local.items() if isinstance(w, WeightWithDynamicFloat8CastTensor)),
            "precomputed": sorted(n for n, w in local.items() if getattr(w, "_precomputed_scale", None) is not None)}
