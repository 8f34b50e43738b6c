"""What a finished `gpudl.fit` leaves for serving beside its weights: `model.onnx`, which `gpudl serve RUN`
serves over the Open Inference Protocol and `gpudl export RUN --format onnx` copies.

ONNX, not torch.export's own saved program: reading that back may unpickle (torch._export.serde falls back
to torch.load(weights_only=False)), and a run folder is untrusted input; an ONNX file is protobuf that
onnxruntime runs without executing Python. The graph is the module's forward on one FP32 tensor
`input` (N, ...) -> `output` (N, ...), N dynamic, traced on the first rows of a training batch.

What cannot be exported is said in one console line and the run still succeeds: a dict batch or several
inputs (one tensor input is what serving takes now), a module that computes its own loss, integer
inputs, a sharded (FSDP) module, missing onnx/onnxscript, or the exporter failing on the module.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError

ONNX = "model.onnx"


def serving_input(batch, loss) -> tuple[torch.Tensor | None, str]:
    """(the first rows of the module's one input in `batch`, "") or (None, why the module cannot be exported from it):
    with `loss=` given a tuple batch is (inputs..., target) and the module gets the inputs."""
    if loss is None:
        return None, ("the module computes its own loss (loss=None), so its forward takes the targets: pass "
                      "loss= to fit for a module that predicts from its inputs alone")
    if isinstance(batch, Mapping):
        return None, (f"its batches are dicts ({', '.join(map(str, batch))}), keyword inputs; serving takes one "
                      f"tensor input for now: batch as (input, target)")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        n = len(batch) - 1 if isinstance(batch, (tuple, list)) else "no"
        return None, f"its forward takes {n} inputs; serving takes one tensor input for now"
    x = batch[0]
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        return None, f"its input is a {type(x).__name__}, not a batch of tensors; serving takes one tensor input"
    if not x.is_floating_point():
        return None, f"its input is {str(x.dtype).removeprefix('torch.')}; gpudl serve takes FP32 inputs for now"
    return x[:2].detach().clone(), ""  # a copy: the batch itself is not kept for the whole run


def leave_onnx(model: nn.Module, example: torch.Tensor | None, why_not: str, folder: Path, name: str,
               console) -> Path | None:
    """Write folder/model.onnx of `model` (not changed: a copy is exported), traced on `example`; None and
    one console line that says why where it cannot be (`why_not` already says so where `example` is None)."""
    out = folder / ONNX
    try:
        if example is None:
            raise UserError(why_not)
        _export(model, example, out, name)
    except UserError as e:
        reason = str(e)
    except Exception as e:  # noqa: BLE001 -- the exporter's own failures: the run has succeeded all the same
        reason = f"torch.onnx.export failed on it ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]})"
    else:
        console.print(f"Model for serving: {out} (gpudl serve {folder})", markup=False, soft_wrap=True)
        return out
    out.unlink(missing_ok=True)
    console.print(f"No {ONNX} for gpudl serve: {reason}", markup=False, soft_wrap=True)
    return None


def _export(model: nn.Module, example: torch.Tensor, out: Path, name: str) -> None:
    from torch.distributed.tensor import DTensor

    from ..interop.onnx import FIT_OUTPUT, INPUT, export_module

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise UserError("the module is sharded across processes (FSDP); load model.safetensors into an unsharded "
                        "copy and export that with torch.onnx.export")
    x = example.detach()[:2].to("cpu", torch.float32)
    x = torch.cat([x, x]) if len(x) == 1 else x  # a batch of 1 would fix the batch axis as 1
    mine = copy.deepcopy(model).to("cpu", torch.float32).eval()
    with torch.no_grad():
        y = mine(x)
    if not isinstance(y, torch.Tensor) or y.dim() < 1 or len(y) != len(x):
        got = f"a {type(y).__name__}" if not isinstance(y, torch.Tensor) else f"shape {list(y.shape)}"
        raise UserError(f"its forward returns {got} for {len(x)} rows; serving takes one tensor with a row per input row")
    meta = {"source": "gpudl.fit", "gpudl_fit_model": name, "input_name": INPUT,
            "input_shape": json.dumps([-1, *x.shape[1:]]), "input_dtype": "float32", "output_name": FIT_OUTPUT,
            "output_shape": json.dumps([-1, *y.shape[1:]])}
    export_module(mine, x, out, meta, INPUT, FIT_OUTPUT, asked_by=f"writing {ONNX}")
    _check_runs(out, mine, x)


def _check_runs(out: Path, model: nn.Module, x: torch.Tensor) -> None:
    """ONNX Runtime, where installed, gives the module's own output on another batch size: the batch axis
    is dynamic and the graph is the module's."""
    try:
        import onnxruntime as ort
    except ImportError:
        return
    x3 = torch.cat([x, x[:1]])
    with torch.no_grad():
        want = model(x3)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"input": x3.numpy()})[0]
    diff = float((torch.from_numpy(got) - want).abs().max()) if tuple(got.shape) == tuple(want.shape) else None
    if diff is None or diff > 1e-4 * max(1.0, float(want.abs().max())):
        raise UserError(f"onnxruntime's output of the exported graph differs from the module's "
                        f"({'shape ' + str(list(got.shape)) if diff is None else f'max abs diff {diff:.3g}'})")
