"""A training run from a config, stage by stage as DESIGN.md draws it.

config -> device -> model (meta, FLOPs counted, then built on the device) -> parallelize ->
data loader -> training loop -> metrics -> checkpoints -> export -> sample.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from . import models
from .checkpoint import Checkpointer, export_safetensors, model_fingerprint
from .config import Config
from .data import Data, DeviceLoader, build_data, first_batches
from .device import DeviceInfo
from .distributed.parallelize import compile_wanted, parallelize
from .errors import UserError
from .metrics import count_training_flops, meta_batch
from .optim import make_optimizer, make_scheduler
from .precision import Precision, make_precision
from .session import Execution, Session, execute, start_session
from .train import Job, TrainState, train_loop


@dataclass
class RunResult:
    """What a run leaves: its folder, summary figures, metric records and the trained model."""

    run_dir: Path | None
    summary: dict
    records: list[dict]
    model: nn.Module


def model_and_data(cfg: Config, rank: int = 0, world: int = 1) -> tuple[models.ModelSpec, Data]:
    spec = models.resolve(cfg.model.name, cfg.model.overrides)
    data = build_data(cfg.data, spec, cfg.train.batch_size, cfg.run.seed, rank, world)
    for key, value in data.model_fit.items():
        if key in cfg.model.overrides and cfg.model.overrides[key] != value:
            raise UserError(f"model.{key}={cfg.model.overrides[key]} does not match the data, which has {value}: "
                            f"drop the setting or set --set model.{key}={value}")
    if data.model_fit:
        spec = models.resolve(cfg.model.name, {**data.model_fit, **cfg.model.overrides})
    return spec, data


def new_run_dir(cfg: Config) -> Path:
    name = cfg.run.name or f"{cfg.model.name}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(cfg.run.dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"run folder {run_dir} already holds a run: continue it with --resume {run_dir}, "
                        f"or choose another --set run.name=...")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def eval_fn_for(spec: models.ModelSpec):
    """Evaluation metrics: loss for every model, accuracy too for classifiers."""
    if spec.is_language_model:
        return lambda model, batch: {"loss": model(batch[0], batch[1])}

    def classify(model, batch):
        logits = model(batch[0]).float()
        return {"loss": F.cross_entropy(logits, batch[1]),
                "accuracy": (logits.argmax(-1) == batch[1]).float().mean()}
    return classify


def build_model(spec: models.ModelSpec, data: Data, info: DeviceInfo, precision: Precision,
                cfg: Config) -> tuple[nn.Module, int]:
    """(model on the device, training FLOPs per sample counted on the meta device)."""
    meta = models.build_meta(spec)
    sample = meta_batch(data.train.batch(0))
    flops = count_training_flops(meta, sample, models.loss_for(spec)) // cfg.train.batch_size
    model = models.build(spec, info.torch_device, precision.param_dtype, seed=cfg.run.seed)
    model = parallelize(model, activation_checkpointing=cfg.train.activation_checkpointing,
                        compile=compile_wanted(cfg.train.compile, info.type))
    return model, flops


def _restore(ckpt: Checkpointer, job: Job, model: nn.Module) -> TrainState:
    path = ckpt.latest()
    if path is None:
        raise UserError(f"nothing to resume: {ckpt.folder} holds no complete checkpoint; start a new run instead")
    extra = ckpt.load(path, model, job.optimizer)
    job.scheduler.load_state_dict(extra["scheduler"])
    job.precision.load_state_dict(extra["scaler"])
    return TrainState(**extra["train_state"])


def train(cfg: Config, resume: str | Path | None = None, console: Console | None = None) -> RunResult:
    """Train the model a config describes; `resume` continues the run in that folder.

    >>> from gpudl.config import load_config
    >>> cfg = load_config(None, ["train.max_steps=2", "run.dir=/tmp/gpudl-doctest", "sample.tokens=0"])
    >>> train(cfg, console=Console(quiet=True)).summary["steps"]
    2
    """
    console = console or Console()
    session = start_session(cfg.run.device, console, cfg.run.keep_host_memory)
    precision = make_precision(cfg.train.precision, session.device)
    spec, data = model_and_data(cfg, session.dp_rank, session.dp_world)
    run_dir = Path(resume) if resume is not None else new_run_dir(cfg)
    model, flops_per_sample = build_model(spec, data, session.device, precision, cfg)
    device = session.device.torch_device
    optimizer = make_optimizer(model, cfg.optim, device.type)
    job = Job(model=model, loss_fn=models.loss_for(spec), optimizer=optimizer,
              scheduler=make_scheduler(optimizer, cfg.optim, cfg.train.max_steps), precision=precision,
              batches=iter(()), eval_fn=eval_fn_for(spec),
              eval_batches=(lambda: first_batches(data.val, cfg.train.eval_batches, device)) if data.val else None)
    fingerprint = model_fingerprint(spec.name, dataclasses.asdict(spec.config), model)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, fingerprint)
    state = _restore(ckpt, job, model) if resume is not None else TrainState()
    (run_dir / "config.toml").write_text(cfg.to_toml())  # only now: a refused resume changes nothing
    loader = DeviceLoader(data.train, device, start=state.batches, num_workers=cfg.data.num_workers)
    job.batches = loader
    _announce(console, session, precision, spec, data, model, state)
    ex = Execution(session=session, job=job, train=cfg.train, log=cfg.log, state=state, loader=loader,
                   model_name=spec.name, unit=data.unit, units_per_sample=data.units_per_sample,
                   flops_per_sample=flops_per_sample, run_dir=run_dir, checkpointer=ckpt,
                   save_every=cfg.checkpoint.every)
    result = execute(ex, console)
    _after_training(cfg, spec, model, run_dir, result.summary, console)
    return RunResult(run_dir, result.summary, result.records, model)


def _announce(console, session: Session, precision: Precision, spec, data: Data, model, state) -> None:
    n = sum(p.numel() for p in model.parameters())
    console.print(f"Precision: {precision.name} ({precision.reason})")
    console.print(f"Model: {spec.name}: {models.describe(spec)}; {n / 1e6:.2f}M parameters")
    console.print(f"Data: {data.description}")
    if state.step:
        console.print(f"Resuming at step {state.step} (batch {state.batches})")


def _after_training(cfg: Config, spec, model: nn.Module, run_dir: Path, summary: dict, console: Console) -> None:
    if cfg.checkpoint.export and session_is_writer():
        try:
            path = export_safetensors(model, run_dir / "model.safetensors",
                                      {"gpudl_model": spec.name, "config": json.dumps(dataclasses.asdict(spec.config))})
            console.print(f"Weights: {path}")
        except UserError as e:
            console.print(f"Weights not exported: {e}", markup=False)
    if spec.is_language_model and cfg.sample.tokens and spec.config.vocab_size >= 256:
        from .generate import sample_text

        t0 = time.perf_counter()
        text = sample_text(model, cfg.sample.prompt, cfg.sample.tokens, cfg.sample.temperature,
                           cfg.sample.top_k, seed=cfg.run.seed)
        (run_dir / "sample.txt").write_text(text)
        console.print(f"Sample ({time.perf_counter() - t0:.1f}s), also in {run_dir / 'sample.txt'}:")
        console.print(text, markup=False, highlight=False)


def session_is_writer() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
