"""`gpudl export`: a run's model in the formats other tools read (safetensors for gpudl serve, a Hugging
Face folder for transformers and vLLM, ONNX and Triton's repository layout), written where it was asked."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from rich.console import Console

from ..checkpoint import export_safetensors
from ..errors import UserError
from .trained import find_run, is_fit_run, load_trained


def export(args, console: Console) -> int:
    """`gpudl export RUN`: the run's model as safetensors (gpudl serve), a Hugging Face folder (--format hf)
    or ONNX (--format onnx, and Triton's layout with --triton-repo)."""

    if args.triton_repo and args.format != "onnx":
        raise UserError(f"--triton-repo writes Triton's layout of an ONNX model: add --format onnx (got --format "
                        f"{args.format})")
    run = find_run(args.run_dir)
    if args.format == "onnx" and is_fit_run(run):
        return _export_fit_onnx(run, args, console)
    t = load_trained(run, args.device or "cpu", "export")
    if args.format == "hf":
        return _export_hf(t, args, console)
    if args.format == "onnx":
        return _export_onnx(t, args, console)
    out = Path(args.out) if args.out else t.run_dir / "model.safetensors"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {str(out)!r}: cannot create its folder ({e.strerror or e}): "
                        f"choose a place you can write") from e
    if out.is_dir():
        raise UserError(f"--out {str(out)!r} is a folder: give a file name, e.g. {out / 'model.safetensors'}")
    meta = {"gpudl_model": t.spec.name, "config": json.dumps(dataclasses.asdict(t.spec.config)), "step": str(t.step)}
    if t.spec.family != "gpt":  # the input shape a server expects, even where the file travels without its config
        meta["image_size"] = str(t.cfg.data.image_size)
    else:
        meta.update(_export_tokenizer(t.run_dir, out.parent))
    console.print(f"Wrote {export_safetensors(t.model, out, meta)}")
    return 0


def _export_hf(t, args, console: Console) -> int:
    """A GPT run as Hugging Face's GPT2LMHeadModel folder with its tokenizer (transformers, vLLM)."""
    from ..data.tokenizer import run_tokenizer
    from ..interop.hf import export_hf

    out = Path(args.out) if args.out else t.run_dir / "hf"
    if out.resolve() == t.run_dir.resolve() or out.is_file():  # its tokenizer.json would change how the run reads text
        raise UserError(f"--out {str(out)!r}: --format hf writes a folder of its own: e.g. --out {t.run_dir / 'hf'}")
    console.print(f"Wrote {export_hf(t.model, run_tokenizer(t.run_dir), out)}: transformers' "
                  f"AutoModelForCausalLM.from_pretrained and vllm serve read it", soft_wrap=True)
    return 0


def _export_onnx(t, args, console: Console) -> int:
    """A classifier run as ONNX (the input `gpudl serve` takes), and Triton's layout of it with --triton-repo."""
    from ..interop.onnx import classifier_metadata, export_classifier, write_triton_repo

    if t.spec.family == "gpt":
        raise UserError(f"--format onnx exports a classifier (the ResNet recipes); {t.run_dir} holds a GPT "
                        f"({t.spec.name}): export it for transformers and vLLM with --format hf")
    shape = (t.spec.config.in_channels, t.cfg.data.image_size, t.cfg.data.image_size)  # (C, H, W)
    source = t.data.train  # an image source normalises with its training part's statistics; synthetic has none
    meta = {"gpudl_model": t.spec.name, "config": json.dumps(dataclasses.asdict(t.spec.config)), "step": str(t.step),
            **classifier_metadata(shape, getattr(source, "mean", None), getattr(source, "std", None))}
    out = export_classifier(t.model, Path(args.out) if args.out else t.run_dir / "model.onnx", shape, meta)
    console.print(f"Wrote {out}", soft_wrap=True)
    if args.triton_repo:
        folder = write_triton_repo(out, Path(args.triton_repo), t.spec.name)
        console.print(f"Wrote {folder}: tritonserver --model-repository={args.triton_repo} serves it", soft_wrap=True)
    return 0


def _export_fit_onnx(run: Path, args, console: Console) -> int:
    """A gpudl.fit run's model.onnx (written by the fit itself: its module is the user's, which no recipe
    rebuilds), copied to --out, and Triton's layout of it with --triton-repo."""
    from ..interop.onnx import write_triton_repo
    from .fit_onnx import ONNX

    found = run / ONNX
    if not found.is_file() or not found.resolve().is_relative_to(run.resolve()):
        raise UserError(f"{run} is a gpudl.fit run without {ONNX} (its fit said why in its last lines): fit with "
                        f"run_dir= on (input tensor, target) batches with loss= and fit writes it, or export your "
                        f"module with torch.onnx.export")
    out = Path(args.out) if args.out else found
    if out.is_dir():
        raise UserError(f"--out {str(out)!r} is a folder: give a file name, e.g. {out / ONNX}")
    if out.resolve() != found.resolve():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(found, out)
        except OSError as e:
            raise UserError(f"--out {str(out)!r}: cannot write it ({e.strerror or e}): choose a place you can write") from e
    console.print(f"Wrote {out}" if out.resolve() != found.resolve() else f"{found} is there already (gpudl.fit wrote it)",
                  soft_wrap=True)
    if args.triton_repo:
        folder = write_triton_repo(out, Path(args.triton_repo), _fit_model_name(out))
        console.print(f"Wrote {folder}: tritonserver --model-repository={args.triton_repo} serves it", soft_wrap=True)
    return 0


def _fit_model_name(onnx_file: Path) -> str:
    """The module's class, as the fit recorded it in the file's metadata (what gpudl serve calls it too)."""
    import onnx  # an optional extra: imported only where a fit's ONNX is exported

    meta = {p.key: p.value for p in onnx.load(str(onnx_file), load_external_data=False).metadata_props}
    return meta.get("gpudl_fit_model", "model").rsplit(".", 1)[-1]


def _export_tokenizer(run_dir: Path, folder: Path) -> dict[str, str]:
    """Copy the run's tokenizer.json beside the export (a server reads it there); the metadata that
    names it, so that a server refuses a folder holding another model's tokenizer.json."""
    from ..data.tokenizer import FILE, FileTokenizer, run_tokenizer

    if not isinstance(run_tokenizer(run_dir), FileTokenizer):  # read, so a damaged one is refused here
        return {"tokenizer": "bytes"}
    data = (run_dir / FILE).read_bytes()
    beside = folder / FILE
    if beside.resolve() != (run_dir / FILE).resolve():
        if beside.is_symlink() or (beside.exists() and beside.read_bytes() != data):
            raise UserError(f"{beside} holds another model's tokenizer: export into a folder of its own "
                            f"(--out FOLDER/model.safetensors)")
        beside.write_bytes(data)
    return {"tokenizer": FILE, "tokenizer_sha256": hashlib.sha256(data).hexdigest()}
