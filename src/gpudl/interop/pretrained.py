"""What `model.init_from` brings into a run, whatever its source (init_from.py says which): the model
settings the source fixes, its weights in gpudl's names, its tokenizer, and how they meet the run's
model (`weights_for`: every tensor checked by name and shape, a classifier's head re-initialised
for another class count; `load_into`: copied in before any parallel wrapping). docs/interop.md.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import models
from ..config import Config
from ..data.tokenizer import ByteTokenizer, Tokenizer
from ..errors import UserError

# A classifier's settings the weights do not fix: another class count re-initialises the head;
# channels_last is a layout, dropout a training choice.
FREE = ("num_classes", "channels_last", "dropout")


@dataclass
class Pretrained:
    """A source's model settings (`name`: a gpudl preset to take, None: the recipe's; `fields`: model
    fields to take; `requires`: fields the recipe's model must already have), its weights in gpudl's
    names (`names`: each one's name in the source, for messages), and its tokenizer (None: the source
    has none, data.tokenizer decides)."""

    source: Path
    kind: str                      # what the start block calls it: "GPT2LMHeadModel", "torchvision ResNet-50", ...
    family: str                    # gpt | resnet
    fields: dict
    state: dict[str, torch.Tensor]
    weights_file: str
    tokenizer: Tokenizer | None = None
    name: str | None = None
    names: dict[str, str] = field(default_factory=dict)
    requires: dict = field(default_factory=dict)

    @property
    def folder(self) -> Path:  # the HF case's word for it
        return self.source

    def describe(self) -> str:
        line = f"{self.kind} from {self.source} ({self.weights_file})"
        if self.family != "gpt":
            return line
        tok = "bytes" if isinstance(self.tokenizer, ByteTokenizer) else \
            Path(self.tokenizer.name).name if self.tokenizer else "none in the source (data.tokenizer)"
        return f"{line}; tokenizer: {tok}"


def with_source_model(cfg: Config, pre: Pretrained, where: Path | None = None) -> Config:
    """`cfg` with its model section taken from the source: its preset (a gpudl source's) and `fields`;
    a recipe or --set value that contradicts them is named, since the weights fix the shape."""
    where = where or pre.source
    family = models.PRESETS.get(cfg.model.name, ("?",))[0]
    if family != pre.family:
        hint = pre.name or ("gpt2-124m (any GPT preset: the source sets its shape)" if pre.family == "gpt"
                            else f"resnet{pre.requires.get('depth', 50)}")
        raise UserError(f"model.init_from={str(pre.source)!r} holds a {pre.family} ({pre.kind}) but "
                        f"model.name={cfg.model.name!r} is not one: set --set model.name={hint}")
    for key, value in pre.fields.items():
        ours = cfg.model.overrides.get(key, value)
        if ours != value:
            raise UserError(f"model.{key}={ours} contradicts {where}, whose model has {key}={value}: drop the "
                            f"setting (model.init_from sets the model's shape)")
    model = dataclasses.replace(cfg.model, name=pre.name or cfg.model.name,
                                overrides={**cfg.model.overrides, **pre.fields})
    return dataclasses.replace(cfg, model=model)


def weights_for(pre: Pretrained, spec: models.ModelSpec) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The source's weights for the run's model `spec`, every tensor of it checked by name and shape
    (tied names once); a classifier's head of another class count is left out (the model's own
    initialisation stays) and said in the returned lines."""
    meta = models.build_meta(spec)
    wanted = {**dict(meta.named_parameters()), **dict(meta.named_buffers())}
    aliases = {n for n, _ in meta.named_parameters(remove_duplicate=False)} - set(wanted)
    state, notes = dict(pre.state), []
    extra = sorted(set(state) - set(wanted) - aliases)
    if extra:
        raise UserError(f"model.init_from: {pre.source} holds {_theirs(pre, extra[0])} (and {len(extra) - 1} "
                        f"more), which this run's {spec.name} does not have: the weights are of another model")
    head = (spec.family == "resnet" and "head.weight" in state
            and state["head.weight"].shape != wanted["head.weight"].shape)
    if head and state["head.weight"].shape[1:] == wanted["head.weight"].shape[1:]:
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        notes.append(f"Head: {_theirs(pre, 'head.weight').rsplit('.', 1)[0]} has {pre.state['head.weight'].shape[0]} "
                     f"classes, this run {spec.config.num_classes}: re-initialised, the rest from the source")
    for name, t in wanted.items():
        if head and name.startswith("head."):
            continue
        if name not in state:
            raise UserError(f"model.init_from: {pre.source} has no tensor {_theirs(pre, name)}, which this "
                            f"run's {spec.name} has: the weights are of another model")
        if tuple(state[name].shape) != tuple(t.shape):
            raise UserError(f"model.init_from: {_theirs(pre, name)} in {pre.source} has shape "
                            f"{tuple(state[name].shape)}, this run's {spec.name} has {tuple(t.shape)}: the weights "
                            f"are of another shape (drop the model setting that changes it)")
    return state, notes


def _theirs(pre: Pretrained, name: str) -> str:
    return pre.names.get(name, name)


@torch.no_grad()
def load_into(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Copy `state` into the parameters and buffers (a BatchNorm's running statistics) this process
    allocated (a pipeline rank's others stay on the meta device), casting to their dtype; a tied head
    is the embedding, copied once; a name `state` lacks (a re-initialised head) keeps its initial value."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if not t.is_meta and name in state:
            t.copy_(state[name])
    return model


def read_safetensors(path: Path, advice: str) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise UserError("model.init_from needs the safetensors package: pip install 'gpudl[export]'") from None
    try:
        return load_file(str(path))  # tensors only: nothing in the file can run
    except Exception as e:  # safetensors raises its own error type for a damaged file
        raise UserError(f"model.init_from: {path} is not a readable safetensors file "
                        f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}): {advice}") from None


def read_pickle(path: Path, advice: str) -> dict[str, torch.Tensor]:
    """A state dict through torch.load(weights_only=True): tensors and plain containers only, so a
    pickle that would build any other object (and could run code) is refused, not run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is paragraphs (and suggests weights_only=False): keep only the line saying what it met
        said = [line.strip() for line in str(e).splitlines() if "Unsupported" in line or "WeightsUnpickler" in line]
        raise UserError(f"model.init_from: {path} holds more than tensors, so torch.load(weights_only=True) refuses "
                        f"it ({(said or ['not a weights-only pickle'])[0][:160]}): {advice}") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise UserError(f"model.init_from: {path} is not a readable PyTorch file ({str(e).splitlines()[0][:120]}): "
                        f"{advice}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"model.init_from: {path} is not a state dict of tensors: {advice}")
    return state
