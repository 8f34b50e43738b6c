"""A checkpoint is untrusted input: a crafted file never runs code, through any command or the API.

Each attack writes a pickle whose `__reduce__` calls `os.system` into one file of a copy of a
real run folder, then rewrites the manifest as an attacker who can write the files would. The
command must stop with one line naming the file, exit status 2, the payload never runs, and
no file of the run folder changes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import TINY
from gpudl.checkpoint import complete_checkpoints
from gpudl.checkpoint.files import manifest
from gpudl.checkpoint.reader import MetadataUnpickler, read_metadata_file
from gpudl.cli import main
from gpudl.config import load_config
from gpudl.errors import UserError
from gpudl.run.recipe import train

COMMANDS = {
    "evaluate": lambda run: ["evaluate", str(run), "--batches", "1"],
    "generate": lambda run: ["generate", str(run), "--tokens", "4"],
    "export": lambda run: ["export", str(run)],
    "train --resume": lambda run: ["train", "--resume", str(run), "--set", "train.max_steps=8"],
}


class Payload:
    """Unpickling this runs a shell command that leaves a marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("untrusted")
    cfg = load_config(None, [*TINY, f"run.dir={root}", "run.name=r", "checkpoint.export=false"])
    return train(cfg, console=Console(quiet=True)).run_dir


@pytest.fixture
def victim(trained, tmp_path) -> tuple[Path, Path, Path]:
    """(a copy of the run folder, its newest checkpoint, the marker file a payload would create)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run, complete_checkpoints(run / "checkpoints")[-1], tmp_path / "PWNED"


def _reseal(ckpt: Path) -> None:
    (ckpt / "manifest.json").write_text(json.dumps(manifest(ckpt)))  # sizes and sums prove nothing


def _metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:
        return MetadataUnpickler(f).load()


def _write_metadata(ckpt: Path, metadata) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def payload_in_metadata(ckpt: Path, marker: Path) -> str:
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return ".metadata"


def payload_inside_metadata(ckpt: Path, marker: Path) -> str:
    """The real metadata, with the payload hidden in a field deep inside it."""
    metadata = _metadata(ckpt)
    metadata.planner_data = {"x": Payload(marker)}
    _write_metadata(ckpt, metadata)
    return ".metadata"


def _append_slice(ckpt: Path, kind: str, obj) -> str:
    """Point the first entry of `kind` (tensor or bytes) at a new slice holding `obj`, as torch.save writes it."""
    metadata = _metadata(ckpt)
    index, info = next((i, s) for i, s in metadata.storage_data.items()  # a model entry: every command reads those
                       if type(metadata.state_dict_metadata[i.fqn]).__name__.startswith(kind)
                       and i.fqn.startswith("model." if kind == "Tensor" else ""))
    data = io.BytesIO()
    torch.save(obj, data)
    shard = ckpt / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(data.getvalue())
    with open(shard, "ab") as f:
        f.write(data.getvalue())
    _write_metadata(ckpt, metadata)
    return info.relative_path


def payload_in_tensor_slot(ckpt: Path, marker: Path) -> str:
    return _append_slice(ckpt, "Tensor", Payload(marker))


def payload_in_bytes_slot(ckpt: Path, marker: Path) -> str:
    return _append_slice(ckpt, "Bytes", Payload(marker))


def metadata_points_outside(ckpt: Path, marker: Path) -> str:
    metadata = _metadata(ckpt)
    next(iter(metadata.storage_data.values())).relative_path = "../../config.toml"
    _write_metadata(ckpt, metadata)
    return ".metadata"


ATTACKS = [payload_in_metadata, payload_inside_metadata, payload_in_tensor_slot, payload_in_bytes_slot,
           metadata_points_outside]


def snapshot(run: Path) -> dict:
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def one_line_error(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return code, err


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_crafted_checkpoint_never_runs_code(capsys, victim, attack, command):
    run, ckpt, marker = victim
    name = attack(ckpt, marker)
    _reseal(ckpt)
    before = snapshot(run)
    code, err = one_line_error(capsys, COMMANDS[command](run))
    assert not marker.exists(), "the payload ran"
    assert code == 2 and f"{ckpt}" in err and name in err, err
    assert snapshot(run) == before


@pytest.mark.parametrize("attack", [payload_in_metadata, payload_in_tensor_slot], ids=lambda a: a.__name__)
def test_the_python_api_refuses_it_too(victim, attack):
    run, ckpt, marker = victim
    name = attack(ckpt, marker)
    _reseal(ckpt)
    before = snapshot(run)
    cfg = load_config(run / "config.toml", ["train.max_steps=8"])
    with pytest.raises(UserError, match=f"was not loaded: {name}"):
        train(cfg, resume=run, console=Console(quiet=True))
    assert not marker.exists() and snapshot(run) == before


def test_the_metadata_reader_resolves_no_foreign_global(tmp_path):
    """Below the commands: the reader refuses before the global is looked up, whatever the module."""
    for module, name in [("os", "system"), ("builtins", "eval"), ("subprocess", "Popen"), ("torch", "load"),
                         ("torch.distributed.checkpoint.metadata", "Any")]:
        call = f"c{module}\n{name}\n(S'touch {tmp_path}/PWNED'\ntR.".encode()  # protocol 0: module.name('...')
        with pytest.raises(pickle.UnpicklingError, match=f"{module}.{name}"):
            MetadataUnpickler(io.BytesIO(call)).load()
    assert not (tmp_path / "PWNED").exists()
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(Exception, match="is not DCP metadata"):
        read_metadata_file(tmp_path / ".metadata")


@pytest.mark.parametrize("edit, words", [
    (lambda s: b"\xff\xfe" + s, "state.json is not readable JSON"),
    (lambda s: s[: len(s) // 2], "state.json is not readable JSON"),
    (lambda s: s.replace(b'"step": 6', b'"step": "__import__(\'os\')"'), "train_state must hold the counters"),
    (lambda s: s.replace(b'"base_lrs"', b'"evil"'), "scheduler is not the state"),
])
def test_an_edited_state_json_is_one_line(capsys, victim, edit, words):
    run, ckpt, _ = victim
    state = ckpt / "state.json"
    state.write_bytes(edit(state.read_bytes()))
    _reseal(ckpt)
    before = snapshot(run)
    code, err = one_line_error(capsys, COMMANDS["train --resume"](run))
    assert code == 2 and words in err, err
    assert snapshot(run) == before


def test_a_manifest_that_names_files_outside_is_refused(capsys, victim):
    run, ckpt, _ = victim
    files = json.loads((ckpt / "manifest.json").read_text())
    files["../../config.toml"] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / "manifest.json").write_text(json.dumps(files))
    code, err = one_line_error(capsys, COMMANDS["evaluate"](run))
    assert code == 2 and "which is not a file name" in err
