"""`model.init_from = PATH`: one dispatch on what PATH is, then one flow (run/recipe.py) for all of them.

- a folder with `config.json`: a Hugging Face GPT-2 folder (hf.py);
- a folder with `config.toml`: a gpudl run, its newest complete checkpoint read through the checkpoint
  store's reader (verified, nothing unpickled), as `gpudl export` reads it;
- a `.safetensors` file whose metadata names a gpudl model (`gpudl export` wrote it), or a folder
  holding one as `model.safetensors`: a gpudl export;
- any other `.safetensors`, or a `.pth`/`.pt` read with `torch.load(weights_only=True)`: a ResNet state
  dict in torchvision's naming (torchvision.py).

A gpudl source gives its preset and model settings (the recipe's model section becomes the source's;
a setting that contradicts it is named) and, for a GPT, its tokenizer. The run is a fine-tune: new
optimizer, schedule and step 0. docs/interop.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .. import models
from ..checkpoint import Checkpointer, complete_checkpoints, model_fingerprint
from ..checkpoint.files import read_json
from ..config import Config
from ..data.tokenizer import FILE, ByteTokenizer, FileTokenizer, Tokenizer, run_tokenizer
from ..errors import UserError
from .hf import folder_shape, read_gpt2_folder
from .pretrained import FREE, Pretrained, read_safetensors, with_source_model
from .torchvision import check_model, read_torchvision

KINDS = ("a Hugging Face GPT-2 folder, a torchvision ResNet state dict (.safetensors, .pth), a gpudl run folder "
         "or a gpudl export (model.safetensors)")
EXPORT = "model.safetensors"
PICKLES = (".pth", ".pt", ".bin")


def source_kind(path: Path) -> tuple[str, Path]:
    """("hf" | "run" | "export" | "torchvision", the folder or file to read), or one line saying why neither."""
    if not path.exists():
        what = "file" if path.suffix else "folder"
        raise UserError(f"model.init_from={str(path)!r}: the {what} does not exist: point it at {KINDS}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        if (path / "config.toml").is_file():
            return "run", path
        if not (path / EXPORT).is_file():
            raise UserError(f"model.init_from={str(path)!r}: the folder has no config.json (Hugging Face), "
                            f"config.toml (a gpudl run) or {EXPORT} (a gpudl export): point it at {KINDS}")
        path = path / EXPORT
    if path.suffix == ".safetensors":
        return ("export" if "gpudl_model" in _metadata(path) else "torchvision"), path
    if path.suffix in PICKLES:
        return "torchvision", path
    raise UserError(f"model.init_from={str(path)!r} is neither a .safetensors nor a {'/'.join(PICKLES)} file nor a "
                    f"folder: point it at {KINDS}")


def read_source(path: str | Path, weights: bool = True) -> Pretrained:
    """What model.init_from names, read and checked; `weights=False`: its model settings only, as cheaply
    as the kind allows (what `gpudl plan` and the launcher's preflight size)."""
    kind, path = source_kind(Path(path))
    if kind == "hf":
        return read_gpt2_folder(path) if weights else folder_shape(path)
    if kind == "run":
        return _run_source(path, weights)
    if kind == "export":
        return _export_source(path, weights)
    return read_torchvision(path)


def with_source(cfg: Config, pre: Pretrained) -> Config:
    """`cfg` with the source's model settings, and the run's model checked to take its weights."""
    cfg = with_source_model(cfg, pre, pre.source / "config.json" if pre.family == "gpt" and not pre.name else None)
    if pre.requires:  # torchvision's: the run's own depth and stem
        check_model(pre, models.from_config(cfg), cfg.data.image_size)
    return cfg


def source_shape(cfg: Config) -> Config:
    """`cfg` with model.init_from's model settings: what `gpudl plan`, --print-config and a launcher see."""
    return cfg if cfg.model.init_from is None else with_source(cfg, read_source(cfg.model.init_from, weights=False))


def _taken(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if k not in FREE}


def _run_source(folder: Path, weights: bool) -> Pretrained:
    found = complete_checkpoints(folder / "checkpoints")
    if not found:
        raise UserError(f"model.init_from: {folder} is a gpudl run without a complete checkpoint: wait for its first "
                        f"save, or give its export (gpudl export)")
    ckpt = found[-1]
    recorded = read_json(ckpt, "state.json").get("model")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("name"), str):
        raise UserError(f"model.init_from: checkpoint {ckpt} does not record its model: give the run's export "
                        f"(gpudl export) instead")
    name, fields = recorded["name"], {k: v for k, v in recorded.items() if k != "name"}
    spec = models.resolve(name, fields)  # every field checked as a --set would be
    kind = f"gpudl run ({name})"
    if not weights:
        return Pretrained(folder, kind, spec.family, _taken(fields), {}, ckpt.name, name=name)
    model = models.build_to_load(spec, torch.device("cpu"))
    # `load` verifies every file against the manifest and the model against the checkpoint's record first
    Checkpointer(ckpt.parent, 1, model_fingerprint(spec.name, spec.config)).load(ckpt, model, optimizer=None,
                                                                                  no_dist=True)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tokenizer = run_tokenizer(folder) if spec.family == "gpt" else None
    return Pretrained(folder, kind, spec.family, _taken(fields), state, f"checkpoints/{ckpt.name}", tokenizer,
                      name=name)


def _metadata(file: Path) -> dict[str, str]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise UserError("model.init_from needs the safetensors package: pip install 'gpudl[export]'") from None
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a malformed header
        raise UserError(f"model.init_from: {file} is not a readable safetensors file "
                        f"({(str(e).splitlines() or [type(e).__name__])[0][:120]}): write it again") from None


def _export_source(file: Path, weights: bool) -> Pretrained:
    meta = _metadata(file)
    try:
        fields = json.loads(meta.get("config", ""))
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise UserError(f"model.init_from: {file}'s metadata 'config' is not a table of model settings: export "
                        f"the run again with gpudl export")
    name = meta["gpudl_model"]
    spec = models.resolve(name, fields)
    kind = f"gpudl export ({name}, step {meta.get('step', '?')})"
    if not weights:
        return Pretrained(file, kind, spec.family, _taken(fields), {}, file.name, name=name)
    state = read_safetensors(file, "export the run again with gpudl export")
    tokenizer = _export_tokenizer(file, meta) if spec.family == "gpt" else None
    return Pretrained(file, kind, spec.family, _taken(fields), state, file.name, tokenizer, name=name)


def _export_tokenizer(file: Path, meta: dict[str, str]) -> Tokenizer:
    """The tokenizer an export records: bytes, or the tokenizer.json gpudl export copied beside it (its sha256)."""
    if meta.get("tokenizer", "bytes") == "bytes":
        return ByteTokenizer()
    path = file.parent / FILE
    if not path.is_file() or path.is_symlink():
        raise UserError(f"model.init_from: {file} was exported with a {FILE} and {path} is missing: copy the run's "
                        f"{FILE} beside it (gpudl export does)")
    if hashlib.sha256(path.read_bytes()).hexdigest() != meta.get("tokenizer_sha256"):
        raise UserError(f"model.init_from: {path} is not the tokenizer {file} was exported with (its sha256 "
                        f"differs): export the run again into a folder of its own")
    return FileTokenizer.from_file(path)
