"""The Open Inference Protocol v2 wire format, checked against tritonclient's own request builder and
response parser (the code an unmodified Triton client runs), and against every malformed body."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.http._utils import _get_inference_request  # noqa: E402  the client's own body builder
from tritonclient.utils import np_to_triton_dtype  # noqa: E402

from gpudl.serve.oip import OutputRequest, ProtocolError, TensorSpec, parse_infer_request  # noqa: E402
from gpudl.serve.oip_reply import (  # noqa: E402
    datatype_of, encode_infer_response, error_body, model_metadata, server_metadata)

LIMIT = 1 << 20
IMAGE = {"x": TensorSpec("x", "FP32", (-1, 3, 2))}
TWO = {"x": TensorSpec("x", "FP32", (-1, 4)), "ids": TensorSpec("ids", "INT64", (-1,))}
TEXT = {"s": TensorSpec("s", "BYTES", (-1,))}


def triton_body(arrays: dict[str, np.ndarray], binary: bool, outputs=None, request_id: str = ""):
    """The body and Inference-Header-Content-Length that `InferenceServerClient.infer` would send."""
    inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    return _get_inference_request(inputs=inputs, request_id=request_id, outputs=outputs, sequence_id=0,
                                  sequence_start=False, sequence_end=False, priority=0, timeout=None,
                                  custom_parameters=None)


def triton_result(body: bytes, headers: dict):
    """The response as `InferenceServerClient.infer` would read it."""
    length = headers.get("Inference-Header-Content-Length")
    return httpclient.InferResult.from_response_body(body, header_length=None if length is None else int(length))


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_fp32_and_int64_inputs_round_trip_from_tritonclient(binary):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    ids = np.array([7, -2**62], dtype=np.int64)
    body, length = triton_body({"x": x, "ids": ids}, binary, request_id="req-1")
    assert (length is not None) == binary   # the client sends the header exactly when it sends binary data
    parsed = parse_infer_request(body, length, TWO, max_body_bytes=LIMIT)
    assert parsed.id == "req-1"
    assert parsed.inputs["x"].dtype == np.float32 and np.array_equal(parsed.inputs["x"], x)
    assert parsed.inputs["ids"].dtype == np.int64 and np.array_equal(parsed.inputs["ids"], ids)
    assert parsed.inputs["x"].flags.writeable   # torch.from_numpy warns on read-only arrays


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_bytes_inputs_round_trip_from_tritonclient(binary):
    s = np.array(["héllo".encode(), b"", b"x" * 300], dtype=object)
    body, length = triton_body({"s": s}, binary)
    parsed = parse_infer_request(body, length, TEXT, max_body_bytes=LIMIT)
    assert list(parsed.inputs["s"]) == list(s)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_response_read_by_tritonclient(binary):
    logits = np.random.default_rng(1).standard_normal((3, 10)).astype(np.float32)
    counts = np.arange(3, dtype=np.int64) - 1
    asked = [httpclient.InferRequestedOutput("logits", binary_data=binary),
             httpclient.InferRequestedOutput("counts", binary_data=binary)]
    body, length = triton_body({"x": np.zeros((3, 3, 2), np.float32)}, True, outputs=asked, request_id="r9")
    parsed = parse_infer_request(body, length, IMAGE, max_body_bytes=LIMIT, output_names=["logits", "counts"])
    assert parsed.outputs == [OutputRequest("logits", binary), OutputRequest("counts", binary)]
    out, headers = encode_infer_response("resnet", "1", parsed.id, {"counts": counts, "logits": logits},
                                         parsed.outputs, binary_default=parsed.binary_data_output)
    assert headers["Content-Type"] == ("application/octet-stream" if binary else "application/json")
    assert ("Inference-Header-Content-Length" in headers) == binary
    result = triton_result(out, headers)
    assert np.array_equal(result.as_numpy("logits"), logits) and result.as_numpy("logits").dtype == np.float32
    assert np.array_equal(result.as_numpy("counts"), counts)
    response = result.get_response()
    assert (response["id"], response["model_name"], response["model_version"]) == ("r9", "resnet", "1")
    assert [o["name"] for o in response["outputs"]] == ["logits", "counts"]   # the order asked for


def test_no_outputs_named_means_all_binary_as_tritonclient_asks():
    body, length = triton_body({"x": np.ones((1, 3, 2), np.float32)}, True)
    assert json.loads(body[:length])["parameters"] == {"binary_data_output": True}
    parsed = parse_infer_request(body, length, IMAGE, max_body_bytes=LIMIT)
    assert parsed.outputs == [] and parsed.binary_data_output
    y = np.array([[0.5, -1.0]], np.float32)
    out, headers = encode_infer_response("m", "1", parsed.id, {"y": y}, parsed.outputs,
                                         binary_default=parsed.binary_data_output)
    assert int(headers["Inference-Header-Content-Length"]) == len(out) - y.nbytes
    assert np.array_equal(triton_result(out, headers).as_numpy("y"), y)
    assert "id" not in json.loads(out[:int(headers["Inference-Header-Content-Length"])])  # none was sent


def test_per_output_binary_overrides_request_default_and_bytes_outputs():
    words = np.array([b"cat", "d\u00f6g".encode()], dtype=object)
    asked = [OutputRequest("label", binary_data=False), OutputRequest("score")]
    out, headers = encode_infer_response("m", "2", "", {"label": words, "score": np.float64([0.25, 1])}, asked,
                                         binary_default=True)
    result = triton_result(out, headers)
    assert result.get_output("label")["data"] == ["cat", "d\u00f6g"]   # JSON: the override
    assert result.get_output("score")["parameters"]["binary_data_size"] == 16   # binary: the default
    assert list(result.as_numpy("label")) == ["cat", "d\u00f6g"]   # tritonclient gives str for JSON BYTES
    assert result.as_numpy("score").tolist() == [0.25, 1.0]
    binary, headers = encode_infer_response("m", "2", "", {"label": words}, [OutputRequest("label", True)])
    assert list(triton_result(binary, headers).as_numpy("label")) == list(words)


def test_nested_and_flat_json_data_agree_and_bool():
    spec = {"b": TensorSpec("b", "BOOL", (2, 2))}
    nested = {"inputs": [{"name": "b", "shape": [2, 2], "datatype": "BOOL", "data": [[True, False], [False, True]]}]}
    flat = {"inputs": [{"name": "b", "shape": [2, 2], "datatype": "BOOL", "data": [True, False, False, True]}]}
    a = parse_infer_request(json.dumps(nested).encode(), None, spec, max_body_bytes=LIMIT).inputs["b"]
    b = parse_infer_request(json.dumps(flat).encode(), None, spec, max_body_bytes=LIMIT).inputs["b"]
    assert np.array_equal(a, np.eye(2, dtype=bool)) and np.array_equal(a, b)


def test_datatype_names_and_metadata_bodies():
    assert [datatype_of(np.dtype(t)) for t in ("f2", "f4", ">f8", "i8", "u1", "?", "O", "S3")] == \
        ["FP16", "FP32", "FP64", "INT64", "UINT8", "BOOL", "BYTES", "BYTES"]
    with pytest.raises(ValueError, match="complex64"):
        datatype_of(np.dtype(np.complex64))
    meta = model_metadata("resnet", ["1"], "pytorch_gpudl", [IMAGE["x"]], [TensorSpec("logits", "FP32", (-1, 10))])
    assert meta == {"name": "resnet", "versions": ["1"], "platform": "pytorch_gpudl",
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, 2]}],
                    "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]}
    assert "binary_tensor_data" in server_metadata()["extensions"] and server_metadata()["name"] == "gpudl"
    assert error_body("boom") == {"error": "boom"}
    with pytest.raises(ProtocolError, match=r"outputs\[0\].name: 'nope'.*'y'") as e:
        encode_infer_response("m", "1", "", {"y": np.zeros(1)}, [OutputRequest("nope")])
    assert e.value.status == 400


def _req(*inputs, **top) -> bytes:
    return json.dumps({"inputs": list(inputs), **top}).encode()


def _x(**over) -> dict:
    entry = {"name": "x", "shape": [1, 3, 2], "datatype": "FP32", "data": [0.0] * 6}
    entry.update(over)
    return {k: v for k, v in entry.items() if v is not ...}


def _binary(sizes: list[int], tail: bytes, shape=(1, 3, 2), header_extra: int = 0):
    entry = {"name": "x", "shape": list(shape), "datatype": "FP32", "parameters": {"binary_data_size": sizes[0]}}
    head = _req(entry)
    return head + tail, len(head) + header_extra


BAD = [  # (body, header length, status, what the message must contain)
    (b"{not json", None, 400, "request body: not valid JSON"),
    (b"\xff\xfe\x00", None, 400, "request body: not valid JSON"),
    (b"[" * 100_000, None, 400, "request body"),
    (b"[1, 2]", None, 400, "request body: expected a JSON object, got a list"),
    (_req(_x(), id=5), None, 400, "id: expected a string, got an integer"),
    (json.dumps({"inputs": "x"}).encode(), None, 400, "inputs: expected a list"),
    (json.dumps({}).encode(), None, 400, "inputs: expected a list of input tensors, got null"),
    (_req(), None, 400, "inputs: missing 'x'"),
    (_req("x"), None, 400, "inputs[0]: expected an object"),
    (_req(_x(name="y")), None, 400, "inputs[0].name: 'y' is not an input of this model; its inputs are 'x'"),
    (_req(_x(name=3)), None, 400, "inputs[0].name: expected a string, got an integer"),
    (_req(_x(), _x()), None, 400, "inputs[1].name: input 'x' is given twice"),
    (_req(_x(datatype="FP33")), None, 400, "inputs[0].datatype: 'FP33' is not a datatype; use one of BOOL, UINT8"),
    (_req(_x(datatype="BF16")), None, 400, "BF16 is not supported"),
    (_req(_x(datatype="FP64")), None, 400, "inputs[0].datatype: input 'x' is FP32, got FP64"),
    (_req(_x(datatype=None)), None, 400, "inputs[0].datatype: expected a datatype string"),
    (_req(_x(shape="1,3,2")), None, 400, "inputs[0].shape: expected a list of integers like [N, 3, 2]"),
    (_req(_x(shape=[1, 3])), None, 400, "inputs[0].shape: [1, 3] has rank 2; input 'x' has shape [N, 3, 2]"),
    (_req(_x(shape=[1, 4, 2])), None, 400, "inputs[0].shape[1]: 4; input 'x' has shape [N, 3, 2]"),
    (_req(_x(shape=[-1, 3, 2])), None, 400, "inputs[0].shape[0]: -1; a variable dimension must be at least 1"),
    (_req(_x(shape=[0, 3, 2], data=[])), None, 400, "inputs[0].shape[0]: 0"),
    (_req(_x(shape=[1.0, 3, 2])), None, 400, "inputs[0].shape[0]: expected an integer, got a number"),
    (_req(_x(shape=[True, 3, 2])), None, 400, "inputs[0].shape[0]: expected an integer, got a boolean"),
    (_req(_x(shape=[10**12, 3, 2])), None, 400, "inputs[0].shape[0]: 1000000000000, more elements than"),
    (_req(_x(shape=[99, 3, 2])), None, 400, "inputs[0].shape: [99, 3, 2] declares 594 elements"),
    (_req(_x(data=[0.0] * 5)), None, 400, "inputs[0].data: 5 elements, but shape [1, 3, 2] needs 6"),
    (_req(_x(data=...)), None, 400, "inputs[0].data: missing"),
    (_req(_x(data="abc")), None, 400, "inputs[0].data: expected a list of values"),
    (_req(_x(data=[[[[0.0]]]] * 6)), None, 400, "inputs[0].data: nested deeper than the tensor's rank 3"),
    (_req(_x(data=[0.0] * 5 + ["1"])), None, 400, "inputs[0].data: element 5 is a string; this datatype takes numbers"),
    (_req(_x(data=[0.0] * 5 + [True])), None, 400, "inputs[0].data: element 5 is a boolean"),
    (_req(_x(data=[0.0] * 5 + [None])), None, 400, "inputs[0].data: element 5 is null"),
    (_req(_x(data=[0.0] * 5 + [1e39])), None, 400, "inputs[0].data: a value is too large for FP32"),
    (_req(_x(data=[0.0] * 5 + [10**400])), None, 400, "inputs[0].data: a value is too large for FP32"),
    (_req(_x(parameters=[])), None, 400, "inputs[0].parameters: expected an object, got a list"),
    (_req(_x(parameters={"shared_memory_region": "r"})), None, 400, "inputs[0].parameters.shared_memory_region"),
    (_req(_x(parameters={"binary_data_size": 24})), None, 400,
     "inputs[0].parameters.binary_data_size: given, but the request has no Inference-Header-Content-Length"),
    (_req(_x(), outputs="y"), None, 400, "outputs: expected a list"),
    (_req(_x(), outputs=[{"name": "y"}, {"name": "y"}]), None, 400, "outputs[1].name: output 'y' is asked for twice"),
    (_req(_x(), outputs=[{"name": "y", "parameters": {"binary_data": "yes"}}]), None, 400,
     "outputs[0].parameters.binary_data: expected a boolean, got a string"),
    (_req(_x(), outputs=[{"name": "y", "parameters": {"classification": 3}}]), None, 400,
     "outputs[0].parameters.classification: not supported"),
    (_req(_x(), parameters={"binary_data_output": 1}), None, 400,
     "parameters.binary_data_output: expected a boolean, got an integer"),
    (_req(_x(), parameters="p"), None, 400, "request.parameters: expected an object"),
    (*_binary([24], b"\0" * 23), 400, "the inputs declare 24 bytes in all, but 23 bytes follow the JSON header"),
    (*_binary([24], b"\0" * 25), 400, "the inputs declare 24 bytes in all, but 25 bytes follow"),
    (*_binary([20], b"\0" * 20), 400, "inputs[0].parameters.binary_data_size: 20 bytes, but shape [1, 3, 2] of FP32 needs 24"),
    (*_binary([-4], b""), 400, "inputs[0].parameters.binary_data_size: -4; it must be 0 or more"),
    (*_binary([2**62], b"\0" * 24), 400, "the inputs declare 4611686018427387904 bytes in all, but 24 bytes follow"),
    (*_binary([24], b"\0" * 24, header_extra=-5), 400, "request body: not valid JSON"),
    (_req(_x()), 0, 400, "Inference-Header-Content-Length: 0 is not within the body"),
    (_req(_x()), 10**9, 400, "Inference-Header-Content-Length: 1000000000 is not within the body"),
    (_req(_x(), pad="x" * LIMIT), None, 413, f"over the limit of {LIMIT} bytes"),
]


@pytest.mark.parametrize("body, length, status, fragment", BAD, ids=[f"{i}:{b[3][:40]}" for i, b in enumerate(BAD)])
def test_bad_request_names_the_field(body, length, status, fragment):
    with pytest.raises(ProtocolError) as e:
        parse_infer_request(body, length, IMAGE, max_body_bytes=LIMIT, output_names=["y"])
    assert e.value.status == status
    assert fragment in e.value.message


BAD_TYPED = [  # datatype-specific rules: (spec, input entry or (entry, binary tail), fragment)
    (TensorSpec("b", "BOOL", (2,)), {"data": [1, 0]}, "inputs[0].data: element 0 is an integer; this datatype takes booleans"),
    (TensorSpec("b", "BOOL", (2,)), {"binary": b"\x01\x02"}, "inputs[0]: a BOOL byte is neither 0 nor 1"),
    (TensorSpec("b", "UINT8", (2,)), {"data": [1, 256]}, "inputs[0].data: a value is outside UINT8's range 0 to 255"),
    (TensorSpec("b", "INT32", (2,)), {"data": [1, 2.5]}, "inputs[0].data: element 1 is a number; this datatype takes integers"),
    (TensorSpec("b", "BYTES", (2,)), {"data": ["a", 3]}, "inputs[0].data: element 1 is an integer; this datatype takes strings"),
    (TensorSpec("b", "BYTES", (2,)), {"binary": b"\x01\0\0\0a\x05\0\0\0ab"}, "BYTES element 1 declares 5 bytes, past the end"),
    (TensorSpec("b", "BYTES", (2,)), {"binary": b"\x01\0\0\0a\x01\0"}, "BYTES element 1 has no 4-byte length"),
    (TensorSpec("b", "BYTES", (2,)), {"binary": b"\0\0\0\0\0\0\0\0zz"}, "2 bytes left over after 2 BYTES elements"),
]


@pytest.mark.parametrize("spec, entry, fragment", BAD_TYPED, ids=[b[2][:40] for b in BAD_TYPED])
def test_bad_values_per_datatype(spec, entry, fragment):
    tensor = {"name": "b", "shape": list(spec.shape), "datatype": spec.datatype}
    tail, length = entry.get("binary"), None
    if tail is None:
        tensor["data"] = entry["data"]
        body = _req(tensor)
    else:
        tensor["parameters"] = {"binary_data_size": len(tail)}
        head = _req(tensor)
        body, length = head + tail, len(head)
    with pytest.raises(ProtocolError) as e:
        parse_infer_request(body, length, {"b": spec}, max_body_bytes=LIMIT)
    assert e.value.status == 400 and fragment in e.value.message


def _mutate(value, rng: random.Random):
    """A random edit somewhere inside a JSON value: wrong types, odd numbers, removed or extra keys."""
    odd = [None, True, -1, 0, 2**70, 1.5, float("nan"), "", "x", [], {}, [[1]], {"a": 1}, -(2**63), [None] * 3]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        roll = rng.random()
        if roll < 0.15:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: rng.choice(odd) if roll < 0.45 else _mutate(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        copy = list(value)
        copy[i] = rng.choice(odd) if rng.random() < 0.4 else _mutate(value[i], rng)
        return copy if rng.random() < 0.9 else copy + copy[:1]
    return rng.choice(odd)


def test_fuzz_only_protocol_errors_escape():
    rng = random.Random(1234)
    valid = json.loads(triton_body({"x": np.ones((2, 4), np.float32), "ids": np.arange(2)}, False,
                                   outputs=[httpclient.InferRequestedOutput("y")])[0])
    binary_body, binary_length = triton_body({"x": np.ones((2, 4), np.float32), "ids": np.arange(2)}, True)
    outcomes = {"ok": 0, "error": 0}
    for case in range(3000):
        kind = case % 3
        if kind == 0:
            body, length = bytes(rng.getrandbits(8) for _ in range(rng.randrange(64))), rng.choice([None, 3, 10])
        elif kind == 1:
            body, length = json.dumps(_mutate(valid, rng)).encode(), None
        else:   # binary: flip, cut or extend the bytes, or lie about the header length
            raw = bytearray(binary_body)
            raw[rng.randrange(len(raw))] = rng.getrandbits(8)
            body = bytes(raw[:rng.randrange(len(raw) + 1)] if rng.random() < 0.3 else raw)
            length = binary_length + rng.choice([0, 0, -1, 1, -40])
        try:
            parse_infer_request(body, length, TWO, max_body_bytes=4096, output_names=["y"])
            outcomes["ok"] += 1
        except ProtocolError as e:
            assert e.status in (400, 413) and e.message
            outcomes["error"] += 1
    assert outcomes["error"] > 2000 and outcomes["ok"] > 0   # the mutations reach both sides
