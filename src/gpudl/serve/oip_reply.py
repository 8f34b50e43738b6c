"""The Open Inference Protocol v2's answers: inference responses (JSON, or a JSON header and
binary outputs as Triton's binary tensor data extension has them), server and model metadata,
errors. The requests are `oip.py`'s."""

from __future__ import annotations

import json
import struct

import numpy as np

from .oip import BINARY_CONTENT_TYPE, DTYPES, JSON_CONTENT_TYPE, OutputRequest, ProtocolError, TensorSpec


def encode_infer_response(model_name: str, model_version: str, request_id: str, outputs: dict[str, np.ndarray],
                          requested: list[OutputRequest], *, binary_default: bool = False) -> tuple[bytes, dict]:
    """The response body and its headers: the `requested` outputs in their order (all of `outputs`
    when none were named), each binary where its `binary_data` says so, else as `binary_default`
    (the request's `binary_data_output`). With any binary output the body is the JSON header then
    the raw tensors, and `Inference-Header-Content-Length` says where the JSON ends.

    >>> body, headers = encode_infer_response("m", "1", "", {"y": np.zeros(2, np.float32)}, [])
    >>> body, headers["Content-Type"]
    (b'{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"FP32","shape":[2],"data":[0.0,0.0]}]}', 'application/json')
    """
    wanted = requested or [OutputRequest(name) for name in outputs]
    entries, blobs = [], []
    for i, ask in enumerate(wanted):
        if ask.name not in outputs:
            raise ProtocolError(400, f"outputs[{i}].name: {ask.name!r} is not an output of this model; "
                                     f"its outputs are {', '.join(map(repr, outputs))}")
        binary = binary_default if ask.binary_data is None else ask.binary_data
        entry, blob = _encode_output(ask.name, np.asarray(outputs[ask.name]), binary)
        entries.append(entry)
        if blob is not None:
            blobs.append(blob)
    head = {"model_name": model_name, "model_version": model_version}
    if request_id:
        head["id"] = request_id
    head["outputs"] = entries
    header = json.dumps(head, separators=(",", ":")).encode()
    if not blobs:
        return header, {"Content-Type": JSON_CONTENT_TYPE}
    return header + b"".join(blobs), {"Content-Type": BINARY_CONTENT_TYPE,
                                      "Inference-Header-Content-Length": str(len(header))}


def datatype_of(dtype: np.dtype) -> str:
    """The protocol's datatype name for a numpy dtype (strings and bytes are BYTES)."""
    if dtype.kind in "OSU":
        return "BYTES"
    for name, candidate in DTYPES.items():
        if name != "BYTES" and candidate.newbyteorder("=") == dtype.newbyteorder("="):
            return name
    raise ValueError(f"numpy dtype {dtype} has no Open Inference Protocol datatype; cast the output "
                     f"to one of {', '.join(DTYPES)}")


def _encode_output(name: str, array: np.ndarray, binary: bool) -> tuple[dict, bytes | None]:
    datatype = datatype_of(array.dtype)
    entry = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if datatype == "BYTES":
        elements = [_as_bytes(v) for v in array.ravel()]
        if not binary:
            # JSON carries strings, so BYTES outputs sent as JSON must be UTF-8 text.
            entry["data"] = [v.decode("utf-8") for v in elements]
            return entry, None
        blob = b"".join(struct.pack("<I", len(v)) + v for v in elements)
    elif not binary:
        entry["data"] = array.ravel().tolist()
        return entry, None
    else:
        blob = np.ascontiguousarray(array, dtype=DTYPES[datatype]).tobytes()
    entry["parameters"] = {"binary_data_size": len(blob)}
    return entry, blob


def _as_bytes(value) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def server_metadata() -> dict:
    """The body of `GET /v2`: the server's name, version and protocol extensions."""
    from ..version import __version__

    return {"name": "gpudl", "version": __version__, "extensions": ["binary_tensor_data"]}


def model_metadata(name: str, versions: list[str], platform: str, inputs: list[TensorSpec],
                   outputs: list[TensorSpec]) -> dict:
    """The body of `GET /v2/models/{name}`; -1 in a shape is a dimension of any size."""
    def tensors(specs: list[TensorSpec]) -> list[dict]:
        return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs]

    return {"name": name, "versions": list(versions), "platform": platform,
            "inputs": tensors(inputs), "outputs": tensors(outputs)}


def error_body(message: str) -> dict:
    """The protocol's error body: `{"error": message}`."""
    return {"error": message}
