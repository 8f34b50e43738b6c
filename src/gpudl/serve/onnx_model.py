"""A `gpudl.fit` run's `model.onnx` served by ONNX Runtime: the fit's module is the user's own, which no
preset rebuilds from its weights, so its graph is what serves (run/fit_onnx.py writes it).

The session is wrapped as a module that takes a batched FP32 tensor and gives one back, which is what the
classifiers' dynamic batching (batching.py) calls: concurrent requests run as one `session.run`. The file
is protobuf: onnxruntime runs it without executing Python from the folder (why not torch.export's format:
docs/serving.md). CUDAExecutionProvider first where the device is CUDA and onnxruntime has it, else the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from .oip import TensorSpec

ONNX = "model.onnx"


class OnnxModule(nn.Module):
    """An onnxruntime session as a module: (N, ...) FP32 on the CPU -> the graph's one output, FP32 on the CPU."""

    def __init__(self, session, input_name: str, output_name: str):
        super().__init__()
        self.session, self.input_name, self.output_name = session, input_name, output_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
        return torch.from_numpy(self.session.run([self.output_name], {self.input_name: given})[0])


def open_fit_onnx(folder: Path, file: Path, info, precision: str) -> dict:
    """The fields of a `load.Loaded` for `file` (folder/model.onnx, already confined to `folder`)."""
    if not file.is_file():
        raise UserError(f"{folder} is a gpudl.fit run without {ONNX}, so there is no graph to serve (its model is "
                        f"your own module, which gpudl cannot rebuild from model.safetensors): fit with run_dir= on "
                        f"(input tensor, target) batches with loss= and fit leaves {ONNX}, or write {file} yourself "
                        f"with torch.onnx.export")
    if precision not in ("auto", "fp32"):
        raise UserError(f"--precision {precision}: {file} is an fp32 graph; serve it with --precision fp32 (or auto)")
    try:
        import onnxruntime as ort
    except ImportError:
        raise UserError(f"serving {file} needs onnxruntime: pip install 'gpudl[serve]'") from None
    cuda = info.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its warnings are about the graph, not for the user to act on
    try:
        session = ort.InferenceSession(str(file), options, providers=providers)
    except Exception as e:  # onnxruntime's own error types for a file it cannot read
        raise UserError(f"{file} is not an ONNX model onnxruntime can run ({(str(e).strip().splitlines() or [''])[0][:200]}): "
                        f"fit the run again, or export the module again with torch.onnx.export") from e
    inputs, outputs = session.get_inputs(), session.get_outputs()
    shapes = [list(v.shape) for v in (*inputs, *outputs)]
    if len(inputs) != 1 or len(outputs) != 1 or any(v.type != "tensor(float)" for v in (*inputs, *outputs)) \
            or any(not s or any(not isinstance(d, int) for d in s[1:]) for s in shapes):
        raise UserError(f"{file} has {len(inputs)} inputs and {len(outputs)} outputs; gpudl serve serves a graph of one "
                        f"FP32 input and one FP32 output, each (N, ...) with only N dynamic, as gpudl.fit writes it")
    meta = session.get_modelmeta().custom_metadata_map
    used = session.get_providers()[0].removesuffix("ExecutionProvider")
    where = info.label if used == "CUDA" else "CPU"
    return dict(model=OnnxModule(session, inputs[0].name, outputs[0].name), spec=None, device=torch.device("cpu"),
                device_label=f"{where} (onnxruntime {used})", dtype=torch.float32,
                name=meta.get("gpudl_fit_model", "model").rsplit(".", 1)[-1], kind="onnx", source=str(file),
                input_shape=tuple(shapes[0][1:]), input_dtype=torch.float32,
                tensors=([TensorSpec(inputs[0].name, "FP32", (-1, *shapes[0][1:]))],
                         [TensorSpec(outputs[0].name, "FP32", (-1, *shapes[1][1:]))]))
