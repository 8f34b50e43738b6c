"""The typed config tree of a training run, and the strict TOML loader.

A run's config is a TOML file (a recipe in `configs/`, or the embedded default) plus
`--set section.key=value` overrides. Each component receives only its own section.

>>> cfg = load_config(None, ["train.max_steps=10", "model.n_layer=2"])
>>> cfg.train.max_steps, cfg.model.name, cfg.model.overrides["n_layer"]
(10, 'gpt-tiny', 2)
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePath
from typing import Any, Literal

from .errors import UserError, unknown_name
from .settings import CommandLineValue, dump_toml, from_dict, option, set_dotted, to_dict

PrecisionName = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-true"]


@dataclass(kw_only=True)
class RunConfig:
    name: str | None = option(None, "run folder name under `dir`; default: <model>-<date>-<time>")
    dir: str = option("runs", "where run folders live")
    seed: int = option(1337, "seed for initialisation, data order and sampling", ge=0)
    device: str = option("auto", "auto | cpu | cuda | rocm | mps | xpu | xla | <type>[:index]")
    keep_host_memory: bool = option(True, "on the CPU, keep freed memory for the next step instead of "
                                          "returning it to the OS (fewer page faults)")


@dataclass(kw_only=True)
class ModelConfig:
    """A preset name plus overrides of that preset's own fields (checked by the model family)."""

    name: str = option("gpt-tiny", "model preset; `gpudl info --models` lists them")
    overrides: dict[str, Any] = field(default_factory=dict, metadata={"doc": "preset fields to change"})


@dataclass(kw_only=True)
class DataConfig:
    kind: Literal["auto", "text", "tokens", "images", "synthetic"] = option(
        "auto", "auto: text for GPT models, images for CNNs")
    path: str | None = option(None, "text file/folder, token file, image folder, or 'sklearn:digits'; "
                                    "none: the embedded standard-library corpus or generated shapes")
    token_dtype: Literal["uint8", "uint16", "uint32"] = option("uint16", "element type of a token file")
    val_fraction: float = option(0.05, "share of the data held out for evaluation", ge=0.0, le=0.5)
    image_size: int = option(32, "side of the square images fed to a CNN", ge=8)
    num_workers: int = option(0, "loader worker processes (0: load in the training process)", ge=0)


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = option(600, "optimizer steps", ge=1)
    batch_size: int = option(32, "samples per micro-batch on each device", ge=1)
    grad_accum: int = option(1, "micro-batches per optimizer step", ge=1)
    precision: PrecisionName = option("auto", "numeric precision; auto picks the fastest safe one")
    compile: bool | Literal["auto"] = option("auto", "torch.compile the model; auto: on for GPUs")
    activation_checkpointing: bool = option(False, "recompute block activations in backward")
    grad_clip: float = option(1.0, "clip the global grad norm to this (0: no clipping)", ge=0.0)
    max_nonfinite: int = option(20, "stop after this many non-finite steps in a row", ge=1)
    eval_every: int = option(200, "evaluate every N steps (0: only at the end)", ge=0)
    eval_batches: int = option(10, "micro-batches per evaluation", ge=1)
    log_every: int = option(10, "log metrics every N steps", ge=1)


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = option(3e-3, "peak learning rate", gt=0.0)
    min_lr_ratio: float = option(0.1, "final lr as a share of the peak (cosine floor)", ge=0.0, le=1.0)
    warmup_steps: int = option(50, "linear warm-up steps", ge=0)
    weight_decay: float = option(0.1, "AdamW weight decay on matrices (not on norms and biases)", ge=0.0)
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon", gt=0.0)
    fused: bool | Literal["auto"] = option("auto", "fused AdamW kernel; auto: where the device has one")


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = option(200, "save every N steps (0: only at the end)", ge=0)
    keep: int = option(2, "checkpoints to keep (the newest ones)", ge=2)
    export: bool = option(True, "write model.safetensors at the end when safetensors is installed")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the processes of a job share the work. The degrees multiply to the number of processes."""

    dp_replicate: int | Literal["auto"] = option("auto", "data-parallel replicas (DDP; HSDP groups with dp_shard)", ge=1)
    dp_shard: int | Literal["auto"] = option("auto", "data-parallel shards (FSDP2)", ge=1)
    tp: int = option(1, "tensor-parallel degree (GPT models)", ge=1)
    pp: int = option(1, "pipeline stages (GPT models)", ge=1)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = option("1f1b", "pipeline schedule")
    pp_microbatches: int = option(4, "micro-batches each batch is split into for the pipeline", ge=1)
    pp_stages_per_rank: int = option(1, "model chunks per pipeline rank (interleaved-1f1b needs >= 2)", ge=1)
    fsdp_reshard_after_forward: bool = option(True, "free gathered parameters after forward (less memory)")
    fsdp_cpu_offload: bool = option(False, "keep sharded parameters and optimizer state in host memory")
    tp_sequence_parallel: bool = option(False, "shard norms and dropout along the sequence too")
    timeout_s: int = option(600, "seconds a collective may wait before the job fails, naming the late rank", ge=10)


@dataclass(kw_only=True)
class LogConfig:
    tensorboard: bool | Literal["auto"] = option("auto", "TensorBoard events; auto: when installed")
    plot: bool = option(True, "loss curve at the end (PNG with matplotlib, SVG without)")
    progress: bool = option(True, "live progress bar on the console")


@dataclass(kw_only=True)
class SampleConfig:
    tokens: int = option(300, "bytes to generate after training a GPT (0: none)", ge=0)
    prompt: str = option("def ", "text that starts the sample")
    temperature: float = option(0.8, "sampling temperature", gt=0.0)
    top_k: int = option(40, "sample among the k likeliest tokens (0: all)", ge=0)


@dataclass(kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def to_toml(self) -> str:
        data = to_dict(self)
        model = data["model"]
        model.update(model.pop("overrides", {}))
        return dump_toml(data)


def recipe_names() -> list[str]:
    """Names of the recipes that ship with gpudl (`gpudl train --config NAME`)."""
    return sorted(p.name[:-5] for p in (resources.files("gpudl") / "configs").iterdir() if p.name.endswith(".toml"))


def _recipe_path(source: str | Path) -> Path:
    path = Path(source)
    if path.is_file():
        return path
    if str(source) in recipe_names():
        return Path(str(resources.files("gpudl") / "configs" / f"{source}.toml"))
    if path.suffix or "/" in str(source):
        raise UserError(f"config file {str(source)!r} not found: pass an existing .toml file "
                        f"or a recipe name ({', '.join(recipe_names())})")
    raise unknown_name("recipe", str(source), recipe_names())


def _read_toml(source: str | Path | None) -> dict:
    if source is None:
        return {}
    path = _recipe_path(source)
    try:
        return tomllib.loads(path.read_text(encoding="utf8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file {str(path)!r} is not valid TOML ({e}): fix the file") from None


def config_from_dict(data: dict) -> Config:
    """Build a Config from a dict shaped like the TOML file; `[model]` keeps extra keys as overrides."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    model = data.pop("model", {})
    if not isinstance(model, dict):
        raise UserError(f"[model] must be a table of settings, got {model!r}")
    cfg = from_dict(Config, data, "")
    name = model.pop("name", ModelConfig().name)
    name = str(name) if isinstance(name, CommandLineValue) else name
    if not isinstance(name, str):
        raise UserError(f"model.name must be a string, got {name!r}")
    model.pop("overrides", None)
    # The model family types its own fields (models.resolve); keep plain TOML values here.
    overrides = {k: v.parsed if isinstance(v, CommandLineValue) else v for k, v in model.items()}
    cfg.model = ModelConfig(name=name, overrides=overrides)
    _check_run_name(cfg.run.name)
    return cfg


def _check_run_name(name: str | None) -> None:
    """A run's folder is `run.dir/run.name`: the name must not lead out of `run.dir`."""
    if name is not None and (PurePath(name).name != name or name in ("", ".", "..") or "\\" in name):
        raise UserError(f"run.name must be a folder name inside run.dir, got {name!r}: choose a name without "
                        f"'/', '\\' or '..' (set run.dir to write elsewhere)")


def load_config(source: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a recipe (path or shipped name; None: the embedded default) and apply `key=value` overrides."""
    data = _read_toml(source)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or "." not in key:
            raise UserError(f"--set expects section.key=value, got {item!r}: e.g. --set train.max_steps=100")
        set_dotted(data, key.strip(), CommandLineValue(raw.strip()))
    return config_from_dict(data)


def replace(cfg: Config, section: str, **changes: Any) -> Config:
    """A copy of `cfg` with some fields of one section changed (used by the Python API)."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})
