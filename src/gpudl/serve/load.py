"""A trained model, ready to serve: from a run folder or an export, onto the best device, in eval mode.

What `path` may be:
- a folder holding `model.safetensors` (what `gpudl export` and a finished run write) and, beside
  it, `config.toml`; the weights come from the safetensors file;
- a run folder without `model.safetensors` (a run still training): its newest complete checkpoint,
  read through gpudl's checkpoint reader, which never runs code from the files;
- a `.safetensors` file whose metadata names the model (`gpudl_model`, `config`), as `gpudl export --out` writes;
- a `gpudl.fit` run folder (config.toml has a [fit] table): its `model.onnx`, run by onnxruntime
  (onnx_model.py), since no preset rebuilds a user's own module from its weights.

A GPT's tokenizer is the `tokenizer.json` beside the weights (a run folder keeps it, `gpudl export`
copies it), else bytes. An export records which it was trained with (`tokenizer`, and the file's
`tokenizer_sha256`), so a folder that holds another model's tokenizer.json is refused, not decoded.

Weights are read with `safetensors.torch.load_file`, never with torch.load or pickle. Everything
read lies inside the model folder: names with `..` and links that lead out of it are refused. The
run's training data is never read (its `data.path` may be absolute and on another machine): the
model's shape comes from the weights' metadata or the checkpoint's own record of it.

For example, `load_model("runs/gpt-tiny-20261203-120000")` gives a `Loaded` whose `kind` is
"gpt" and whose `context_length` is the model's block size.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import models
from ..data.tokenizer import FILE as TOKENIZER
from ..data.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer
from ..errors import UserError
from .oip import TensorSpec

WEIGHTS = "model.safetensors"
CONFIG = "config.toml"
# Serving precision: the weights are cast once (nothing is trained, so no fp32 master copy). The
# training policies' names are accepted as their serving dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-mixed": torch.bfloat16,
          "bf16-true": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass
class Loaded:
    """A model ready to serve. For classifiers `input_shape` is (C, H, W); for GPT `context_length`,
    `vocab_size` and `tokenizer` are set."""

    model: nn.Module
    spec: models.ModelSpec | None  # None: a fit run's model.onnx (kind "onnx"), whose graph is not a preset
    device: torch.device
    device_label: str              # e.g. "cuda:0 (NVIDIA H100)"
    dtype: torch.dtype
    name: str                      # what clients call the model
    kind: str                      # "classifier" | "gpt" | "onnx" (batched like a classifier)
    source: str                    # where the weights came from (a file, or a checkpoint folder)
    input_shape: tuple[int, ...] | None = None
    input_dtype: torch.dtype | None = None
    context_length: int | None = None
    vocab_size: int | None = None
    tokenizer: Tokenizer | None = None
    tensors: tuple[list[TensorSpec], list[TensorSpec]] | None = None  # (inputs, outputs) as the ONNX graph names them

    @property
    def describe(self) -> str:
        if self.spec is None:
            return f"{self.name} as ONNX, fp32, from {self.source}"
        return f"{models.describe(self.spec)}, {str(self.dtype).removeprefix('torch.')}, from {self.source}"

    @property
    def inputs(self) -> list[TensorSpec]:
        if self.tensors is not None:
            return self.tensors[0]
        if self.kind == "gpt":
            return [TensorSpec("text_input", "BYTES", [-1])]
        return [TensorSpec("input", "FP32", [-1, *self.input_shape])]

    @property
    def outputs(self) -> list[TensorSpec]:
        if self.tensors is not None:
            return self.tensors[1]
        if self.kind == "gpt":
            return [TensorSpec("text_output", "BYTES", [-1])]
        return [TensorSpec("logits", "FP32", [-1, self.spec.config.num_classes])]


def load_model(path: str | Path | None, device: str = "auto", precision: str = "auto") -> Loaded:
    """Load a run folder, an export folder or an exported `.safetensors` file onto `device` for serving.

    `precision`: auto (bf16 on an accelerator that has it, else fp32) | fp32 | bf16 | fp16.
    `path` None: the newest run under ./runs.
    """
    from ..device import detect

    info = detect(device)
    fit = _fit_run(path)
    if fit is not None:  # a user's own module: its ONNX graph serves, not a preset rebuilt from weights
        from .onnx_model import ONNX, open_fit_onnx

        loaded = Loaded(**open_fit_onnx(fit, _inside(fit, ONNX), info, precision))
        loaded.name = _name(loaded.name)
        return loaded
    dtype = serving_dtype(precision, info)
    spec, model, source, folder, meta = _read(path, info.torch_device)
    model = model.to(dtype).eval().requires_grad_(False)
    common = dict(model=model, spec=spec, device=info.torch_device, device_label=info.label, dtype=dtype,
                  name=_name(spec.name), source=source)
    if spec.family == "gpt":
        c = spec.config
        return Loaded(**common, kind="gpt", context_length=c.block_size, vocab_size=c.vocab_size,
                      tokenizer=_tokenizer(folder, meta, spec, source))
    image_size = _image_size(folder, meta, spec)
    shape = (spec.config.in_channels, image_size, image_size)
    return Loaded(**common, kind="classifier", input_shape=shape, input_dtype=torch.float32)


def _fit_run(path) -> Path | None:
    """`path` where it is a gpudl.fit run folder (its config.toml has a [fit] table), else None."""
    from ..run.trained import is_fit_run

    return Path(path) if path is not None and Path(path).is_dir() and is_fit_run(Path(path)) else None


def serving_dtype(precision: str, info) -> torch.dtype:
    """The dtype weights are served in on device `info` (a DeviceInfo)."""
    if precision == "auto":
        # bf16 where the accelerator runs it natively; on a CPU, fp32 unless asked (bf16 there is
        # faster only on some CPUs, and classifiers' callers compare logits against fp32).
        return torch.bfloat16 if info.type != "cpu" and info.bf16 else torch.float32
    if precision not in DTYPES:
        raise UserError(f"unknown precision {precision!r} for serving; choose one of: auto, fp32, bf16, fp16")
    dtype = DTYPES[precision]
    needs = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if needs and not getattr(info, needs):
        raise UserError(f"precision {precision!r} needs {needs} support, which {info.label} lacks: use --precision fp32")
    return dtype


def _read(path, device: torch.device):
    """(spec, model with weights on `device`, source, the folder it lies in, the weights' metadata)."""
    from ..run.trained import find_run

    if path is not None and Path(path).is_file():
        file = Path(path)
        if file.suffix != ".safetensors":
            raise UserError(f"{str(path)!r} is not a .safetensors file: give a run folder, an export folder "
                            f"or a file that `gpudl export` wrote")
        spec, model, meta = _from_safetensors(file, file.parent, device)
        return spec, model, str(file), file.parent, meta
    folder = Path(path) if path is not None else find_run(None)
    if not folder.is_dir():
        raise UserError(f"{str(path)!r} does not exist: give a run folder (runs/...), an export folder or a "
                        f".safetensors file")
    if _inside(folder, WEIGHTS).is_file():
        spec, model, meta = _from_safetensors(_inside(folder, WEIGHTS), folder, device)
        return spec, model, str(folder / WEIGHTS), folder, meta
    find_run(str(folder))  # a run folder, or a UserError that says what the folder lacks
    spec, model, ckpt = _from_checkpoint(folder, device)
    return spec, model, str(ckpt), folder, {}


def _inside(folder: Path, name: str) -> Path:
    """folder/name, refused if `name` climbs out (`..`, absolute) or resolves outside `folder` (a link out)."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise UserError(f"{name!r} is not a name inside the model folder {folder}: only plain relative names are read")
    path = folder / name
    if path.exists() and not path.resolve().is_relative_to(folder.resolve()):
        raise UserError(f"{path} is a link to {path.resolve()}, outside the model folder {folder}: copy the "
                        f"file into the folder instead of linking it")
    return path


def _name(raw: str) -> str:
    """A model name that is safe in a URL path: letters, digits, '.', '_' and '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-.") or "model"


def _metadata(file: Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a malformed header
        raise UserError(f"{file} is not a readable safetensors file ({str(e).splitlines()[0]}): export the "
                        f"run again with `gpudl export`") from e


def _spec(file: Path, folder: Path, meta: dict[str, str]) -> models.ModelSpec:
    """The model the weights belong to: from the file's metadata, else from config.toml beside it."""
    if "gpudl_model" in meta and "config" in meta:
        try:
            fields = json.loads(meta["config"])
        except ValueError as e:
            raise UserError(f"{file}'s metadata 'config' is not JSON ({e}): export the run again with gpudl export") from e
        if not isinstance(fields, dict):
            raise UserError(f"{file}'s metadata 'config' must be a table of model settings, got {fields!r}")
        return models.resolve(meta["gpudl_model"], fields)  # every field checked as a --set would be
    config = _inside(folder, CONFIG)
    if not config.is_file():
        raise UserError(f"{file} does not say which model it holds (no gpudl_model/config metadata) and "
                        f"{config} is missing: export with `gpudl export`, or put the run's config.toml beside it")
    from ..config import load_config

    cfg = load_config(config)
    return models.from_config(cfg)


def _tokenizer(folder: Path, meta: dict[str, str], spec: models.ModelSpec, source: str) -> Tokenizer:
    """The tokenizer of a GPT's weights: as the export recorded it, else the tokenizer.json beside them, else bytes."""
    path = _inside(folder, TOKENIZER)
    if meta.get("tokenizer") == "bytes":  # exported from a byte-level run: a tokenizer.json here is another's
        tokenizer = ByteTokenizer()
    elif path.is_file():
        want = meta.get("tokenizer_sha256")
        if want and hashlib.sha256(path.read_bytes()).hexdigest() != want:
            raise UserError(f"{path} is not the tokenizer {source} was exported with (its sha256 differs): "
                            f"export the run again into a folder of its own")
        tokenizer = FileTokenizer.from_file(path)
    elif meta.get("tokenizer_sha256"):
        raise UserError(f"{source} was exported with a {TOKENIZER} and {path} is missing: copy the run's "
                        f"{TOKENIZER} beside it (gpudl export does)")
    else:
        return ByteTokenizer()  # a model of fewer ids than bytes still serves the prompts it knows (checked per request)
    if tokenizer.vocab_size > spec.config.vocab_size:
        raise UserError(f"{tokenizer.name} has {tokenizer.vocab_size} tokens, more than the {spec.config.vocab_size} "
                        f"of {source}'s model: it is another model's tokenizer; serve the run's own export")
    return tokenizer


def _image_size(folder: Path, meta: dict[str, str], spec: models.ModelSpec) -> int | None:
    """A classifier's image side: the file's metadata, else config.toml's data.image_size, else the default."""
    from ..config import DataConfig, load_config

    if spec.family == "gpt":
        return None
    size = meta.get("image_size", "")
    if size.isdigit() and int(size) >= 8:
        return int(size)
    config = _inside(folder, CONFIG)
    return load_config(config).data.image_size if config.is_file() else DataConfig().image_size


def _from_safetensors(file: Path, folder: Path, device: torch.device):
    """(spec, model, metadata): the model built on `device` with the file's weights, all checked."""
    from safetensors.torch import load_file

    meta = _metadata(file)
    spec = _spec(file, folder, meta)
    try:
        tensors = load_file(str(file))  # tensors only: nothing in the file can run
    except Exception as e:
        raise UserError(f"{file} is not a readable safetensors file ({str(e).splitlines()[0]}): export the "
                        f"run again with `gpudl export`") from e
    model = models.build_to_load(spec, device)
    _load_weights(model, tensors, file)
    return spec, model, meta


def _load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Copy `tensors` into `model`, refusing missing, unknown, misshapen or non-finite ones."""
    own = model.state_dict(keep_vars=True)
    unknown = sorted(set(tensors) - set(own))
    if unknown:
        raise UserError(f"{file} holds tensors this {type(model).__name__} does not have ({', '.join(unknown[:3])}): "
                        f"it was exported from another model; export this run again")
    # A tied weight is stored once (GPT's head shares the token embedding): its other names may be absent.
    stored = {id(own[k]) for k in tensors}
    missing = [k for k, t in own.items() if k not in tensors and id(t) not in stored]
    if missing:
        raise UserError(f"{file} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: it was "
                        f"exported from another model; export this run again")
    for k, t in tensors.items():
        if t.shape != own[k].shape:
            raise UserError(f"{file}: {k} has shape {list(t.shape)}, the model expects {list(own[k].shape)}: "
                            f"the config does not match these weights; export the run again")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UserError(f"{file}: {k} holds values that are not finite (NaN or Inf): export an earlier checkpoint")
    model.load_state_dict(tensors, strict=False)


def _from_checkpoint(run: Path, device: torch.device):
    """(spec, model, checkpoint folder): the run's newest complete checkpoint, verified before it is read."""
    from ..checkpoint import Checkpointer, complete_checkpoints, model_fingerprint
    from ..checkpoint.files import read_json
    from ..config import load_config

    cfg = load_config(_inside(run, CONFIG))
    found = complete_checkpoints(_inside(run, "checkpoints"))
    if not found:
        raise UserError(f"{run} has neither {WEIGHTS} nor a complete checkpoint: export it with `gpudl export`, "
                        f"or wait for the run's first checkpoint")
    ckpt = found[-1]
    # The checkpoint records the model it holds (every field that shapes it); the run's config alone
    # may lack what its data decided (an image folder's class count) and reading the data is not ours.
    recorded = read_json(ckpt, "state.json").get("model")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("name"), str):
        raise UserError(f"checkpoint {ckpt} does not record its model: serve an export (gpudl export) instead")
    fields = {k: v for k, v in recorded.items() if k != "name"}
    spec = models.resolve(recorded["name"], fields)
    model = models.build_to_load(spec, device)
    # `load` verifies every file against the manifest and the model against the record first.
    Checkpointer(ckpt.parent, cfg.checkpoint.keep, model_fingerprint(spec.name, spec.config)).load(
        ckpt, model, optimizer=None, no_dist=True)
    return spec, model, ckpt
