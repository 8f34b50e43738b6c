"""Model presets and how to build them: on the meta device first, then on the target device.

>>> spec = resolve("gpt-tiny", {"n_layer": 2})
>>> spec.family, spec.config.n_layer
('gpt', 2)
>>> resolve("resnet50", image_size=224).config.small_stem  # "auto": the ImageNet stem above 64 px
False
"""

from __future__ import annotations

import copy

import dataclasses
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UserError, did_you_mean, unknown_name
from ..config.settings import check_value, field_types
from ..config.tree import DataConfig
from .gpt import GPT, GPTConfig
from .resnet import STEM_RULE, ResNet, ResNetConfig, small_stem_for

FAMILIES: dict[str, tuple[type, type[nn.Module]]] = {"gpt": (GPTConfig, GPT), "resnet": (ResNetConfig, ResNet)}


def _gpt2(n_layer: int, n_head: int, d_model: int) -> GPTConfig:
    # GPT-2's vocabulary (50257) padded to a multiple of 64, which tensor cores prefer.
    return GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, block_size=1024, vocab_size=50304)


PRESETS: dict[str, tuple[str, Any]] = {
    "gpt-tiny": ("gpt", GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128, vocab_size=256)),
    "gpt-small": ("gpt", GPTConfig(n_layer=6, n_head=6, d_model=384, block_size=256, vocab_size=256)),
    "gpt2-124m": ("gpt", _gpt2(12, 12, 768)),
    "gpt2-350m": ("gpt", _gpt2(24, 16, 1024)),
    "gpt2-774m": ("gpt", _gpt2(36, 20, 1280)),
    "gpt2-1.5b": ("gpt", _gpt2(48, 25, 1600)),
    "gpt-1b": ("gpt", GPTConfig(n_layer=18, n_head=16, d_model=2048, block_size=2048, vocab_size=50304)),
    **{f"resnet{d}": ("resnet", ResNetConfig(depth=d)) for d in (18, 34, 50, 101, 152)},
}


DEFAULT_IMAGE_SIZE = DataConfig().image_size  # what a model resolved without a run's config is sized for


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: its preset name, family and the family's own config (no "auto" left in it)."""

    name: str
    family: str
    config: Any
    # settings that were "auto", each with what decided it: {"small_stem": 224} (the image size)
    auto: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_language_model(self) -> bool:
        return self.family == "gpt"


def from_config(cfg, fitted: dict[str, Any] | None = None) -> ModelSpec:
    """The model a run's config describes, as every path (train, plan, bench, serve) resolves it: the
    preset with `[model]`'s settings over `fitted` (what the data implies: classes, channels), its
    "auto" settings decided by the run's data (a ResNet's stem by `data.image_size`)."""
    return resolve(cfg.model.name, {**(fitted or {}), **cfg.model.overrides}, cfg.data.image_size)


def resolve(name: str, overrides: dict[str, Any] | None = None, image_size: int = DEFAULT_IMAGE_SIZE) -> ModelSpec:
    """The preset `name` with `overrides` applied, each checked against the family's fields, and every
    setting left to "auto" decided for images of side `image_size` (a run's own: `from_config`)."""
    if name not in PRESETS:
        raise unknown_name("model", name, PRESETS)
    family, base = PRESETS[name]
    cls = FAMILIES[family][0]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types = field_types(cls)
    changes = {}
    for key, value in (overrides or {}).items():
        if key not in fields:
            raise UserError(f"unknown setting 'model.{key}' for {family} model {name!r}{did_you_mean(key, fields)}; "
                            f"[model] takes: name, {', '.join(fields)}")
        changes[key] = check_value(f"model.{key}", types[key], value, dict(fields[key].metadata))
    config, auto = _decide_auto(family, dataclasses.replace(base, **changes), image_size)
    return ModelSpec(name, family, config, auto)


def _decide_auto(family: str, config: Any, image_size: int) -> tuple[Any, dict[str, Any]]:
    """`config` with its "auto" settings decided, and what decided each. A value set explicitly stays."""
    if family == "resnet" and config.small_stem == "auto":
        return dataclasses.replace(config, small_stem=small_stem_for(image_size)), {"small_stem": image_size}
    return config, {}


def preset(name: str) -> ModelSpec:
    """The preset as declared, "auto" settings undecided: to describe (`gpudl info --models`), not to build."""
    if name not in PRESETS:
        raise unknown_name("model", name, PRESETS)
    return ModelSpec(name, *PRESETS[name])


def build(spec: ModelSpec, device: torch.device, dtype: torch.dtype = torch.float32,
          seed: int = 0) -> nn.Module:
    """Build on the meta device (no memory), then allocate on `device` and initialise there."""
    return materialize(build_meta(spec), device, dtype, seed)


def build_to_load(spec: ModelSpec, device: torch.device) -> nn.Module:
    """The model allocated on `device` for weights that are loaded next: its initialisation runs but
    draws no random numbers (GPT-2 124M's take a second on two cores), so the values it would draw are
    left as allocated. Ties and constant fills (a norm's ones and zeros) are made as in `build`; the
    caller must load every weight (the checkpoint's load refuses one that lacks any)."""
    model = build_meta(spec).to_empty(device=device)
    with _SkipRandomFills():
        model.init_weights()
    return model


# In-place random fills, as the dispatcher sees them (nn.init.normal_ arrives as aten.normal_).
_aten = torch.ops.aten
_RANDOM_FILLS = {_aten.normal_, _aten.uniform_, _aten.bernoulli_, _aten.random_, _aten.exponential_,
                 _aten.log_normal_, _aten.cauchy_, _aten.geometric_}


class _DrawForMeta(TorchDispatchMode):
    """A random fill of a meta tensor draws as many numbers on `device` (into scratch memory, then
    dropped), so the generator advances exactly as it would had the tensor been allocated.

    Exact for fills whose draws do not depend on the values drawn (normal_, uniform_: GPT's init).
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _RANDOM_FILLS and args[0].is_meta:
            func(torch.empty_like(args[0], device=self.device), *args[1:], **kwargs)
            return args[0]
        return func(*args, **kwargs)


class _SkipRandomFills(TorchDispatchMode):
    """Random fills do nothing: for a model whose weights are about to be overwritten."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _RANDOM_FILLS:
            return args[0]
        return func(*args, **(kwargs or {}))


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0,
                only: Iterable[str] | None = None) -> nn.Module:
    """Allocate a meta-device model on `device` and initialise it at `seed`, in place.

    `only`: allocate just these submodules (one pipeline rank's share; the rest stays on the
    meta device). They get exactly the values they have in the whole model at `seed`: the random
    draws of the parts left out are still made, so the generator advances as for the whole model.
    """
    if only is None:
        model.to_empty(device=device)
    else:
        for name in only:
            model.get_submodule(name).to_empty(device=device)
    torch.manual_seed(seed)
    with _DrawForMeta(device) if only is not None else nullcontext():
        model.init_weights()
    return model.to(dtype)


def parameter_count(spec: ModelSpec) -> int:
    """How many parameters the model has (counted on the meta device: nothing allocated)."""
    return sum(p.numel() for p in build_meta(spec).parameters())


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of any module (a user's too) whose parameters and buffers are on the meta device: its
    shapes, dtypes and structure, no values copied and nothing allocated. The module is left untouched."""
    meta = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
            if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta")
            for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, meta)


def build_meta(spec: ModelSpec) -> nn.Module:
    """The model with every tensor on the meta device: shapes without storage."""
    with torch.device("meta"):
        return FAMILIES[spec.family][1](spec.config)


def loss_for(spec: ModelSpec):
    """The training loss of a preset as `loss(model, batch) -> scalar`."""
    if spec.is_language_model:
        return lambda model, batch: model(batch[0], batch[1])
    return lambda model, batch: F.cross_entropy(model(batch[0]).float(), batch[1])


def describe(spec: ModelSpec) -> str:
    c = spec.config
    if spec.family == "gpt":
        return f"GPT {c.n_layer} layers, {c.n_head} heads, width {c.d_model}, context {c.block_size}, vocab {c.vocab_size}"
    return f"ResNet-{c.depth}, {c.num_classes} classes, {_stem(spec)}"


def _stem(spec: ModelSpec) -> str:
    if spec.config.small_stem == "auto":  # a preset as declared: the rule
        return STEM_RULE
    stem = "small stem" if spec.config.small_stem else "ImageNet stem"
    return f"{stem} (auto: {spec.auto['small_stem']} px images)" if "small_stem" in spec.auto else stem


__all__ = ["GPT", "GPTConfig", "ResNet", "ResNetConfig", "PRESETS", "ModelSpec", "from_config", "resolve", "preset",
           "build", "build_meta", "materialize", "loss_for", "describe"]
