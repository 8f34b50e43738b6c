"""A classifier as ONNX, for ONNX Runtime and Triton's `onnxruntime_onnx` backend (`gpudl export --format onnx`).

The graph takes what `gpudl serve` takes over the Open Inference Protocol, so one client works against
both: input `input`, FP32, (N, C, H, W), pixels already normalised per channel as the run trained on
them, and output `logits`, FP32, (N, num_classes). N is a dynamic axis. The input shape and the
normalisation travel in the model's `metadata_props` (a client that has only the file can prepare its
pixels); `--triton-repo DIR` lays the file out as Triton's `--model-repository` reads it:
DIR/NAME/config.pbtxt and DIR/NAME/1/model.onnx. docs/interop.md shows both in use.

A `gpudl.fit` run leaves its module the same way (`export_module`, run/fit_onnx.py): one FP32 tensor
`input` (N, ...) -> `output` (N, ...), N dynamic, traced on one batch of its training data.

Exported by torch's own exporter (`torch.onnx.export(dynamo=True)`, which needs `onnx` and
`onnxscript`: the `onnx` extra), on the CPU in fp32.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError

# The names `gpudl serve` gives a classifier's tensors (serve/load.py `Loaded.inputs`/`outputs`);
# tests/unit/test_onnx_export.py holds the two to each other.
INPUT, OUTPUT = "input", "logits"
# A gpudl.fit module's output (not always logits: a regression's values, an embedding): `gpudl serve`
# names the outputs of a served model.onnx as its graph does.
FIT_OUTPUT = "output"
# Triton's dynamic batcher, set as `gpudl serve`'s own defaults (--max-batch-size, --max-queue-delay-ms).
MAX_BATCH_SIZE, MAX_QUEUE_DELAY_US = 32, 5000
# ONNX element types (onnx.TensorProto.DataType names) -> Triton's DataType (model_config.proto).
_TRITON_TYPES = {"FLOAT": "TYPE_FP32", "FLOAT16": "TYPE_FP16", "BFLOAT16": "TYPE_BF16", "DOUBLE": "TYPE_FP64",
                 "UINT8": "TYPE_UINT8", "INT8": "TYPE_INT8", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
                 "BOOL": "TYPE_BOOL"}


def classifier_metadata(input_shape: tuple[int, int, int], mean: torch.Tensor | None,
                        std: torch.Tensor | None) -> dict[str, str]:
    """What a client needs to prepare the input, as ONNX `metadata_props` (strings): its shape (C, H, W)
    after the dynamic batch axis, and the per-channel normalisation the run trained with (`mean` and
    `std` None: the run's data was not pixels, e.g. data.kind=synthetic's standard-normal inputs)."""
    meta = {"input_name": INPUT, "input_shape": json.dumps([-1, *input_shape]), "input_layout": "NCHW",
            "input_dtype": "float32", "output_name": OUTPUT}
    if mean is None or std is None:
        meta["normalisation"] = "none: the run trained on standard-normal inputs, not pixels"
        return meta
    meta["normalisation"] = "input = (pixel / 255 - mean) / std per channel; pixels 0-255, channels as trained"
    meta["mean"] = json.dumps([float(v) for v in mean.flatten()])  # float32's own values: repr round-trips them
    meta["std"] = json.dumps([float(v) for v in std.flatten()])
    return meta


def export_classifier(model: nn.Module, out: Path, input_shape: tuple[int, int, int],
                      metadata: dict[str, str]) -> Path:
    """Write `model` (images (N, C, H, W) -> logits (N, K)) to the ONNX file `out`, batch axis dynamic,
    `metadata` in its metadata_props. The model is moved to the CPU in fp32 and put in eval mode."""
    example = torch.zeros(2, *input_shape)  # (N, C, H, W); 2, not 1: a size-1 axis would be fixed as 1
    return export_module(model, example, out, metadata)


def export_module(model: nn.Module, example: torch.Tensor, out: Path, metadata: dict[str, str],
                  input_name: str = INPUT, output_name: str = OUTPUT, asked_by: str = "--format onnx") -> Path:
    """Write `model` (one tensor (N, ...) -> one tensor (N, ...)) to the ONNX file `out`, traced on
    `example` (N >= 2: a size-1 axis would be fixed as 1), its first axis dynamic in the input and the
    output, `metadata` in its metadata_props. The model is moved to the CPU in fp32 and put in eval mode
    (give a copy where the caller's module must stay where it is). `asked_by` names what wanted the file
    in the line that says what is missing."""
    _check_exporter(asked_by)
    out = _file(out)
    model = model.to("cpu", torch.float32).eval()
    example = example.to("cpu", torch.float32)
    batch = torch.export.Dim("batch", min=1)
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(model, (example,), None, input_names=[input_name], output_names=[output_name],
                                    dynamic_shapes=({0: batch},), dynamo=True, external_data=False,
                                    verbose=False)
    program.model.metadata_props.update(metadata)
    tmp = out.with_name(out.name + ".tmp")
    try:
        program.save(str(tmp), external_data=False)  # one file: Triton and onnxruntime read it alone
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"could not write {out} ({e.strerror or e}): choose a place with room that you can "
                        f"write") from e
    return out


def _check_exporter(what: str) -> None:
    missing = [name for name in ("onnx", "onnxscript") if find_spec(name) is None]
    if missing:
        raise UserError(f"{what} needs {' and '.join(missing)}, which torch.onnx.export uses: "
                        f"pip install 'gpudl[onnx]'")


def _file(out: Path) -> Path:
    if out.is_dir():
        raise UserError(f"--out {str(out)!r} is a folder: give a file name, e.g. {out / 'model.onnx'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {str(out)!r}: cannot create its folder ({e.strerror or e}): "
                        f"choose a place you can write") from e
    return out


@contextmanager
def _quiet():
    """The exporter's chatter (torchvision ops it skips, deprecations in its own code) is not the user's to read."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def write_triton_repo(onnx_file: Path, repo: Path, name: str, max_batch_size: int = MAX_BATCH_SIZE,
                      max_queue_delay_us: int = MAX_QUEUE_DELAY_US) -> Path:
    """Lay `onnx_file` out in Triton's model repository `repo`: repo/NAME/1/model.onnx and
    repo/NAME/config.pbtxt, the config read from the file's own graph. Returns the model's folder."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"  # as gpudl serve names a model
    folder = repo / name
    try:
        (folder / "1").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(onnx_file, folder / "1" / "model.onnx")
        (folder / "config.pbtxt").write_text(triton_config(onnx_file, name, max_batch_size, max_queue_delay_us))
    except OSError as e:
        raise UserError(f"--triton-repo {str(repo)!r}: cannot write {folder} ({e.strerror or e}): "
                        f"choose a folder you can write") from e
    return folder


def triton_config(onnx_file: Path, name: str, max_batch_size: int, max_queue_delay_us: int) -> str:
    """config.pbtxt (protobuf text of Triton's ModelConfig) for an ONNX file whose every input and output
    has the batch as its first, dynamic axis: `dims` are the other axes, as Triton wants them when
    max_batch_size > 0."""
    import onnx

    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    inputs = [_tensor(v) for v in graph.input]
    outputs = [_tensor(v) for v in graph.output]
    return "\n".join([
        "# gpudl export --format onnx: Triton's onnxruntime backend; the batch axis is dynamic (max_batch_size)",
        "# and Triton's dynamic batcher forms the batches, as gpudl serve does (its defaults: 32 rows, 5 ms).",
        f'name: "{name}"', 'platform: "onnxruntime_onnx"', f"max_batch_size: {max_batch_size}",
        _tensors("input", inputs), _tensors("output", outputs),
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_queue_delay_us}\n}}", ""])


def _tensor(value) -> tuple[str, str, list[int]]:
    """(name, Triton data type, dims without the batch axis) of a graph input or output."""
    import onnx

    kind = onnx.TensorProto.DataType.Name(value.type.tensor_type.elem_type)
    dims = value.type.tensor_type.shape.dim
    assert dims and not dims[0].HasField("dim_value"), f"{value.name}: the first axis must be the dynamic batch"
    return value.name, _TRITON_TYPES[kind], [d.dim_value if d.HasField("dim_value") else -1 for d in dims[1:]]


def _tensors(field: str, tensors: list[tuple[str, str, list[int]]]) -> str:
    entries = ",\n".join(f'  {{\n    name: "{name}"\n    data_type: {kind}\n    dims: [ {", ".join(map(str, dims))} ]'
                         f"\n  }}" for name, kind, dims in tensors)
    return f"{field} [\n{entries}\n]"
