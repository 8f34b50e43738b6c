"""The benchmark grid: models x devices x precisions x compile on/off, checked before anything runs.

Bad input (a device that is not present, a precision a device cannot run, an unknown model)
stops the benchmark before its first step, with one line that names what exists. Once the
grid runs, a cell that fails is recorded with its reason and the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .. import models
from ..config import Config, load_config, recipe_names
from ..data import build_data
from ..device import DeviceInfo, available, detect
from ..errors import UserError
from ..observe.flops import count_training_flops, meta_batch
from ..training.precision import auto_policy, make_precision
from .cells import Cell, Timing

DEFAULT_MODELS = ("gpt-tiny", "resnet18")


@dataclass(kw_only=True)
class Plan:
    """What a benchmark runs, every input already checked."""

    configs: dict[str, Config]                 # model name as asked -> its config
    devices: list[DeviceInfo]                  # best first; the first one also measures data loading
    precisions: dict[str, list[str]]           # device label -> precision policies to run there
    compile: tuple[bool, ...] = (False, True)
    timing: Timing = field(default_factory=Timing)
    specs: dict[str, models.ModelSpec] = field(default_factory=dict)

    def cells(self) -> list[Cell]:
        """The compute grid (synthetic data), then one real-data cell per model on the first device."""
        grid = [Cell(name, self.specs[name], cfg, info, p, c)
                for name, cfg in self.configs.items() for info in self.devices
                for p in self.precisions[info.label] for c in self.compile]
        first = self.devices[0]
        return grid + [Cell(name, self.specs[name], cfg, first, self.loader_precision(first), False, real_data=True)
                       for name, cfg in self.configs.items()]

    def loader_precision(self, info: DeviceInfo) -> str:
        """The data-loading cell runs where training would: the device's auto precision if benchmarked."""
        asked = self.precisions[info.label]
        best = auto_policy(info)[0]
        return best if best in asked else asked[0]


def model_configs(names: list[str], config: str | None, sets: list[str], batch_size: int | None) -> dict[str, Config]:
    """One config per model: a shipped recipe of that name, else the default settings with that preset."""
    names = list(names) or ([] if config else list(DEFAULT_MODELS))
    out = {}
    if config:
        cfg = load_config(config, sets)
        out[cfg.model.name if not names else f"{cfg.model.name} ({config})"] = cfg
    for name in names:
        if name in recipe_names():
            out[name] = load_config(name, sets)
        else:
            models.resolve(name)  # an unknown name fails here, listing the presets
            out[name] = load_config(None, [*sets, f"model.name={name}"])
    if batch_size is not None:
        if batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {batch_size}")
        out = {k: replace(c, train=replace(c.train, batch_size=batch_size)) for k, c in out.items()}
    return out


def bench_devices(requested: list[str]) -> list[DeviceInfo]:
    """The devices asked for ('all' or none: every device present, one of each kind), best first."""
    if not requested or "all" in requested:
        requested = available()
    infos = []
    for r in requested:
        info = detect(r)  # an absent device fails here, naming the devices present
        if info.label not in [i.label for i in infos]:
            infos.append(info)
    return infos


def default_precisions(info: DeviceInfo) -> list[str]:
    """fp32 and each mixed precision the device runs natively (bf16-true only when asked for)."""
    return ["fp32"] + [p for p, need in (("bf16-mixed", "bf16"), ("fp16-mixed", "fp16")) if getattr(info, need)]


def device_precisions(devices: list[DeviceInfo], requested: list[str]) -> dict[str, list[str]]:
    """Precisions per device; each one asked for is checked against every device asked for."""
    out = {}
    for info in devices:
        if not requested:
            out[info.label] = default_precisions(info)
            continue
        names = []
        for p in requested:
            name = make_precision(p, info).name  # unknown or unsupported: one line naming what this device runs
            if name not in names:
                names.append(name)
        out[info.label] = names
    return out


def make_plan(*, model_names: list[str] = (), config: str | None = None, sets: list[str] = (), devices: list[str] = (),
              precisions: list[str] = (), compile: tuple[bool, ...] = (False, True), timing: Timing = Timing(),
              batch_size: int | None = None) -> Plan:
    """Check every input and resolve it; nothing is measured yet."""
    if timing.steps < 1 or timing.warmup < 0 or timing.max_seconds <= 0:
        raise UserError(f"--steps must be >= 1, --warmup >= 0 and --max-seconds > 0, got {timing.steps}, "
                        f"{timing.warmup} and {timing.max_seconds}")
    configs = model_configs(list(model_names), config, list(sets), batch_size)
    specs = {name: models.from_config(c) for name, c in configs.items()}
    infos = bench_devices(list(devices))
    return Plan(configs=configs, devices=infos, precisions=device_precisions(infos, list(precisions)),
                compile=tuple(compile), timing=timing, specs=specs)


def sample_batch(spec: models.ModelSpec, cfg: Config) -> tuple:
    """A synthetic batch of the benchmarked shape (on the host)."""
    return build_data(replace(cfg.data, kind="synthetic"), spec, cfg.train.batch_size, cfg.run.seed).train.batch(0)


def flops_per_sample(spec: models.ModelSpec, cfg: Config) -> int:
    """Training FLOPs of one sample, counted once on the meta device, as a training run counts them."""
    batch = sample_batch(spec, cfg)
    return count_training_flops(models.build_meta(spec), meta_batch(batch), models.loss_for(spec)) // len(batch[0])


def speedups(cells: list[dict]) -> None:
    """Each successful cell's samples/s over the fastest CPU cell of the same model (none without a CPU cell)."""
    for rec in cells:
        cpu = [c["samples_per_s"] for c in cells if c["model"] == rec["model"] and c["device_kind"] == "cpu"
               and c["status"] == "ok" and c["data"] == "synthetic"]
        if rec["status"] == "ok" and cpu:
            rec["speedup_vs_cpu"] = rec["samples_per_s"] / max(cpu)


__all__ = ["Plan", "make_plan", "default_precisions", "flops_per_sample", "sample_batch", "speedups"]
