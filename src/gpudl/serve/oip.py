"""The Open Inference Protocol v2 over HTTP (KServe v2, Triton), with Triton's binary tensor data
extension: pure functions from request bytes to numpy arrays (responses: `oip_reply.py`).

A request is either one JSON object, or a JSON header of `Inference-Header-Content-Length` bytes
followed by the raw tensors of the inputs that carry `parameters.binary_data_size`, in input order
(little-endian, row-major; BYTES elements as a 4-byte length and the bytes). A response is JSON,
or a JSON header and binary outputs when the request asked for them with `binary_data` on an
output or `binary_data_output` for all (what `tritonclient.http` asks for when it names no output).

Everything a client can send wrong raises `ProtocolError` whose message names the field and what
is allowed; no client-declared size is allocated before it is checked against the bytes present.

>>> spec = {"x": TensorSpec("x", "FP32", (-1, 2))}
>>> body = b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}'
>>> parse_infer_request(body, None, spec, max_body_bytes=2**20).inputs["x"]
array([[1., 2.]], dtype=float32)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

# Little-endian numpy types of the protocol's datatypes (the wire order is little-endian).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"), "UINT8": np.dtype("u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
_ALLOWED = ", ".join(DTYPES)
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"


class ProtocolError(Exception):
    """A request gpudl refuses: `status` is the HTTP status (400 for a malformed or invalid request,
    404 for an unknown model, 413 for a body over the limit), `message` names the field and the fix.
    `param` and `code` fill the OpenAI error shape where they apply."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class TensorSpec:
    """An input or output a model declares: `shape` uses -1 for a dimension of any size (the batch)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class OutputRequest:
    """An output the client asked for; `binary_data` None means "as the request-level default"."""

    name: str
    binary_data: bool | None = None


@dataclass
class InferRequest:
    """A parsed, validated inference request: one array per expected input."""

    id: str
    inputs: dict[str, np.ndarray]
    outputs: list[OutputRequest] = field(default_factory=list)
    binary_data_output: bool = False   # request-level `parameters.binary_data_output`
    priority: int = 0                  # request-level `parameters.priority`: lower is served earlier (as vLLM's)


def kind_of(value) -> str:
    """How an error message names a JSON value's type."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _typed(value, types: type | tuple, where: str, wanted: str):
    # bool is a subclass of int in Python, but JSON true is not a number: refuse it where ints are asked.
    if not isinstance(value, types) or (isinstance(value, bool) and types is not bool):
        raise ProtocolError(400, f"{where}: expected {wanted}, got {kind_of(value)}")
    return value


def _parameters(obj: dict, where: str) -> dict:
    return _typed(obj.get("parameters", {}), dict, f"{where}.parameters", "an object")


def parse_infer_request(body: bytes, header_length: int | None, expected: dict[str, TensorSpec], *,
                        max_body_bytes: int, output_names: list[str] | None = None) -> InferRequest:
    """Validate an inference request and decode its inputs.

    `header_length` is the `Inference-Header-Content-Length` header (None when absent: the whole
    body is JSON). `output_names`, when given, lets requested outputs be checked before the model runs.

    >>> spec = {"x": TensorSpec("x", "INT64", (-1,))}
    >>> parse_infer_request(b'{"id": "7", "inputs": [{"name": "x", "shape": [2], "datatype": "INT64",'
    ...                     b' "data": [3, 4]}]}', None, spec, max_body_bytes=1024).id
    '7'
    """
    if len(body) > max_body_bytes:
        raise ProtocolError(413, f"request body: {len(body)} bytes, over the limit of {max_body_bytes} bytes")
    header, binary = _split(body, header_length)
    request = _load_json(header)
    request_id = _typed(request.get("id", ""), str, "id", "a string")
    params = _parameters(request, "request")
    binary_default = _typed(params.get("binary_data_output", False), bool,
                            "parameters.binary_data_output", "a boolean")
    priority = _typed(params.get("priority", 0), int, "parameters.priority", "an integer")
    if not -2**31 <= priority < 2**31:
        raise ProtocolError(400, f"parameters.priority: {priority} is not in [-2**31, 2**31)")
    raw_inputs = _typed(request.get("inputs"), list, "inputs", "a list of input tensors")
    headers = _input_headers(raw_inputs, expected, binary is not None, len(body))
    _check_binary_total(headers, binary)
    inputs, offset = {}, 0
    for where, entry, spec, shape, size in headers:
        if size is None:
            inputs[spec.name] = _json_tensor(entry.get("data"), spec.datatype, shape, f"{where}.data")
        else:
            inputs[spec.name] = _binary_tensor(binary[offset:offset + size], spec.datatype, shape, where)
            offset += size
    outputs = _output_requests(request.get("outputs", []), output_names)
    return InferRequest(request_id, inputs, outputs, binary_default, priority)


def _split(body: bytes, header_length: int | None) -> tuple[bytes, bytes | None]:
    if header_length is None:
        return body, None
    if not 0 < header_length <= len(body):
        raise ProtocolError(400, f"Inference-Header-Content-Length: {header_length} is not within the body's "
                                 f"{len(body)} bytes; it must be the length of the JSON header, 1 to {len(body)}")
    return body[:header_length], body[header_length:]


def _load_json(header: bytes) -> dict:
    try:
        request = json.loads(header)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        raise ProtocolError(400, f"request body: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    return _typed(request, dict, "request body", "a JSON object")


def _input_headers(raw_inputs: list, expected: dict[str, TensorSpec], has_binary: bool, body_len: int):
    """(where, entry, spec, shape, binary size or None) per input, every field checked, nothing decoded."""
    headers, seen = [], set()
    for i, entry in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        _typed(entry, dict, where, "an object with name, shape, datatype and data")
        name = _typed(entry.get("name"), str, f"{where}.name", "a string")
        if name not in expected:
            raise ProtocolError(400, f"{where}.name: {name!r} is not an input of this model; "
                                     f"its inputs are {', '.join(map(repr, expected))}")
        if name in seen:
            raise ProtocolError(400, f"{where}.name: input {name!r} is given twice")
        seen.add(name)
        spec = expected[name]
        _check_datatype(entry.get("datatype"), spec, f"{where}.datatype")
        shape = _check_shape(entry.get("shape"), spec, f"{where}.shape", body_len)
        size = _binary_size(entry, where, has_binary)
        headers.append((where, entry, spec, shape, size))
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ProtocolError(400, f"inputs: missing {', '.join(map(repr, missing))}; this model needs "
                                 f"{', '.join(map(repr, expected))}")
    return headers


def _check_datatype(datatype, spec: TensorSpec, where: str) -> None:
    _typed(datatype, str, where, f"a datatype string ({_ALLOWED})")
    if datatype not in DTYPES:
        hint = " (BF16 is not supported: send FP32)" if datatype == "BF16" else ""
        raise ProtocolError(400, f"{where}: {datatype!r} is not a datatype{hint}; use one of {_ALLOWED}")
    if datatype != spec.datatype:
        raise ProtocolError(400, f"{where}: input {spec.name!r} is {spec.datatype}, got {datatype}")


def _check_shape(shape, spec: TensorSpec, where: str, body_len: int) -> tuple[int, ...]:
    want = "[" + ", ".join("N" if d == -1 else str(d) for d in spec.shape) + "]"
    _typed(shape, list, where, f"a list of integers like {want}")
    if len(shape) != len(spec.shape):
        raise ProtocolError(400, f"{where}: {shape} has rank {len(shape)}; input {spec.name!r} has shape {want}")
    for k, (got, fixed) in enumerate(zip(shape, spec.shape)):
        _typed(got, int, f"{where}[{k}]", "an integer")
        if got > body_len:   # see below: no dimension can be longer than the body is
            raise ProtocolError(400, f"{where}[{k}]: {got}, more elements than the {body_len} bytes of the "
                                     f"request body can hold")
        if fixed == -1 and got < 1:
            raise ProtocolError(400, f"{where}[{k}]: {got}; a variable dimension must be at least 1")
        if fixed != -1 and got != fixed:
            raise ProtocolError(400, f"{where}[{k}]: {got}; input {spec.name!r} has shape {want}")
    count = 1
    for got in shape:
        count *= got
    # Every element takes at least one byte of the body (JSON or binary), so a larger count is a lie
    # about the data; checking it here bounds every later allocation by the body's real size.
    if count > body_len:
        raise ProtocolError(400, f"{where}: {shape} declares {count} elements, more than the "
                                 f"{body_len} bytes of the request body can hold")
    return tuple(shape)


def _binary_size(entry: dict, where: str, has_binary: bool) -> int | None:
    params = _parameters(entry, where)
    for unsupported in ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"):
        if unsupported in params:
            raise ProtocolError(400, f"{where}.parameters.{unsupported}: shared memory is not supported; "
                                     f"send the data in the body (JSON or binary)")
    if "binary_data_size" not in params:
        if "data" not in entry:
            raise ProtocolError(400, f"{where}.data: missing; give data, or parameters.binary_data_size "
                                     f"with the bytes after the JSON header")
        return None
    size = _typed(params["binary_data_size"], int, f"{where}.parameters.binary_data_size", "an integer")
    if not has_binary:
        raise ProtocolError(400, f"{where}.parameters.binary_data_size: given, but the request has no "
                                 f"Inference-Header-Content-Length header to say where the JSON ends")
    if size < 0:
        raise ProtocolError(400, f"{where}.parameters.binary_data_size: {size}; it must be 0 or more")
    if "data" in entry:
        raise ProtocolError(400, f"{where}.data: given together with parameters.binary_data_size; give one")
    return size


def _check_binary_total(headers: list, binary: bytes | None) -> None:
    if binary is None:
        return
    declared = sum(size for *_, size in headers if size is not None)
    if declared != len(binary):
        raise ProtocolError(400, f"parameters.binary_data_size: the inputs declare {declared} bytes in all, "
                                 f"but {len(binary)} bytes follow the JSON header")


def _json_tensor(data, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    flat = _flatten(data, len(shape), where)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(flat) != count:
        raise ProtocolError(400, f"{where}: {len(flat)} elements, but shape {list(shape)} needs {count}")
    return _json_values(flat, datatype, where).reshape(shape)


def _flatten(data, rank: int, where: str) -> list:
    """The leaves in row-major order; `data` may be flat or nested, never deeper than the rank
    (an explicit stack, so a deeply nested body cannot exhaust Python's recursion)."""
    _typed(data, list, where, "a list of values (flat or nested, row-major)")
    flat, stack = [], [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= max(rank, 1):
                    raise ProtocolError(400, f"{where}: nested deeper than the tensor's rank {rank}")
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _json_values(flat: list, datatype: str, where: str) -> np.ndarray:
    if datatype == "BYTES":
        _all(flat, lambda v: isinstance(v, str), where, "strings")
        out = np.empty(len(flat), dtype=object)   # element-wise: np.array would build a fixed-width array
        # surrogatepass: a lone surrogate in a JSON string still has bytes; BYTES need not be text.
        out[:] = [v.encode("utf-8", "surrogatepass") for v in flat]
        return out
    if datatype == "BOOL":
        _all(flat, lambda v: isinstance(v, bool), where, "booleans")
        return np.array(flat, dtype=np.bool_)
    dtype = DTYPES[datatype]
    if dtype.kind in "iu":
        _all(flat, lambda v: type(v) is int, where, "integers")
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise ProtocolError(400, f"{where}: a value is outside {datatype}'s range {info.min} to {info.max}")
        return np.array(flat, dtype=dtype.newbyteorder("="))
    _all(flat, lambda v: type(v) in (int, float), where, "numbers")
    return _floats(flat, datatype, where)


def _floats(flat: list, datatype: str, where: str) -> np.ndarray:
    try:
        wide = np.array(flat, dtype=np.float64)
    except OverflowError:   # an integer literal beyond float64
        raise ProtocolError(400, f"{where}: a value is too large for {datatype}") from None
    with np.errstate(over="ignore"):
        out = wide.astype(DTYPES[datatype].newbyteorder("="))
    if np.any(np.isfinite(wide) & ~np.isfinite(out)):
        raise ProtocolError(400, f"{where}: a value is too large for {datatype}")
    return out


def _all(flat: list, ok, where: str, wanted: str) -> None:
    for i, v in enumerate(flat):
        if not ok(v):
            raise ProtocolError(400, f"{where}: element {i} is {kind_of(v)}; this datatype takes {wanted}")


def _binary_tensor(raw: bytes, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if datatype == "BYTES":
        return _bytes_elements(raw, count, where).reshape(shape)
    dtype = DTYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(400, f"{where}.parameters.binary_data_size: {len(raw)} bytes, but shape "
                                 f"{list(shape)} of {datatype} needs {count * dtype.itemsize}")
    if datatype == "BOOL" and raw.translate(None, b"\x00\x01"):
        raise ProtocolError(400, f"{where}: a BOOL byte is neither 0 nor 1")
    # A native-order copy: writable (torch.from_numpy wants that) and free of the request body.
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)


def _bytes_elements(raw: bytes, count: int, where: str) -> np.ndarray:
    out, pos = np.empty(count, dtype=object), 0
    for i in range(count):
        if pos + 4 > len(raw):
            raise ProtocolError(400, f"{where}: BYTES element {i} has no 4-byte length; the data ends at {pos}")
        (n,) = struct.unpack_from("<I", raw, pos)
        if pos + 4 + n > len(raw):
            raise ProtocolError(400, f"{where}: BYTES element {i} declares {n} bytes, past the end of its data")
        out[i], pos = raw[pos + 4:pos + 4 + n], pos + 4 + n
    if pos != len(raw):
        raise ProtocolError(400, f"{where}.parameters.binary_data_size: {len(raw) - pos} bytes left over "
                                 f"after {count} BYTES elements")
    return out


def _output_requests(raw, output_names: list[str] | None) -> list[OutputRequest]:
    _typed(raw, list, "outputs", "a list of {name, parameters}")
    out, seen = [], set()
    for i, entry in enumerate(raw):
        where = f"outputs[{i}]"
        _typed(entry, dict, where, "an object with a name")
        name = _typed(entry.get("name"), str, f"{where}.name", "a string")
        if output_names is not None and name not in output_names:
            raise ProtocolError(400, f"{where}.name: {name!r} is not an output of this model; "
                                     f"its outputs are {', '.join(map(repr, output_names))}")
        if name in seen:
            raise ProtocolError(400, f"{where}.name: output {name!r} is asked for twice")
        seen.add(name)
        params = _parameters(entry, where)
        if "classification" in params:
            raise ProtocolError(400, f"{where}.parameters.classification: not supported; ask for the raw output")
        binary = params.get("binary_data")
        if binary is not None:
            _typed(binary, bool, f"{where}.parameters.binary_data", "a boolean")
        out.append(OutputRequest(name, binary))
    return out
