"""gpudl export --format onnx: one ResNet run exported once (in-process, through the command line's
main), then read back by onnxruntime, by onnx and as Triton reads its config.pbtxt.

What is not tested here: a real Triton server loading the repository (docs/interop.md says so).
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from gpudl.cli import main

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

RESNET = ["model.name=resnet18", "model.width=16", "data.kind=images", "data.image_size=16", "train.batch_size=8",
          "train.max_steps=2", "checkpoint.every=2", "train.eval_every=0", "train.precision=fp32",
          "train.compile=false", "train.time_budget_s=0", "log.progress=false", "run.device=cpu"]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(run folder, its model.onnx, the Triton repository, what export printed)."""
    root = tmp_path_factory.mktemp("onnx")
    assert main(["train", *_sets([*RESNET, f"run.dir={root / 'runs'}", "run.name=r"])]) == 0
    run, repo = root / "runs" / "r", root / "repo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["export", str(run), "--format", "onnx", "--triton-repo", str(repo)]) == 0
    return run, run / "model.onnx", repo, printed.getvalue()


def _trained(run):
    from gpudl.run.trained import load_trained

    return load_trained(run, "cpu")


def test_export_says_what_it_wrote_and_nothing_else(exported):
    run, onnx_file, repo, printed = exported
    assert printed.splitlines() == [f"Wrote {onnx_file}",
                                    f"Wrote {repo / 'resnet18'}: tritonserver --model-repository={repo} serves it"]


def test_onnxruntime_equals_gpudl_at_batch_1_and_8_from_one_file(exported):
    """One exported file answers both batch sizes (the batch axis is dynamic), as the run's own model does."""
    run, onnx_file, _, _ = exported
    t = _trained(run)
    model, classes = t.model, t.spec.config.num_classes
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(0)
    for batch in (1, 8):
        x = torch.randn(batch, 3, 16, 16, generator=g)  # (N, C, H, W), normalised pixels' scale
        with torch.no_grad():
            want = model(x).numpy()
        (got,) = session.run(["logits"], {"input": x.numpy()})
        assert got.shape == want.shape == (batch, classes)
        assert np.abs(got - want).max() <= 1e-4


def test_the_graph_takes_and_gives_what_gpudl_serve_does(exported):
    """Input and output names, dtypes and shapes equal the ones `gpudl serve` declares over the Open
    Inference Protocol for the same run: a Triton client works against either unchanged."""
    from gpudl.serve.load import load_model

    run, onnx_file, _, _ = exported
    served = load_model(str(run), device="cpu", precision="fp32")
    graph = onnx.load(str(onnx_file)).graph
    oip = {"FP32": onnx.TensorProto.FLOAT}
    for declared, tensors in ((served.inputs, graph.input), (served.outputs, graph.output)):
        assert [t.name for t in tensors] == [s.name for s in declared]
        for spec, t in zip(declared, tensors):
            assert t.type.tensor_type.elem_type == oip[spec.datatype]
            assert _dims(t) == [-1, *spec.shape[1:]] and spec.shape[0] == -1


def test_metadata_holds_the_input_shape_and_the_normalisation_a_client_needs(exported):
    """uint8 pixels prepared with the file's own mean and std (as a client with only the file would) give
    the logits the run's model gives on the batch its data pipeline normalised."""
    run, onnx_file, _, _ = exported
    meta = {p.key: p.value for p in onnx.load(str(onnx_file)).metadata_props}
    assert json.loads(meta["input_shape"]) == [-1, 3, 16, 16] and meta["input_layout"] == "NCHW"
    assert meta["gpudl_model"] == "resnet18" and meta["step"] == "2"
    t = _trained(run)
    mean, std = np.array(json.loads(meta["mean"])), np.array(json.loads(meta["std"]))
    assert np.array_equal(mean.astype(np.float32), t.data.train.mean.flatten().numpy())  # to the bit
    assert np.array_equal(std.astype(np.float32), t.data.train.std.flatten().numpy())
    pixels, _ = t.data.train.wire_batch(0)  # uint8 (B, C, H, W), as a camera or a JPEG gives them
    x = ((pixels.numpy() / 255.0 - mean[:, None, None]) / std[:, None, None]).astype(np.float32)
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    (got,) = session.run(["logits"], {"input": x})
    with torch.no_grad():
        want = t.model(t.data.train.batch(0)[0]).numpy()
    assert np.abs(got - want).max() <= 1e-4


def test_a_run_on_synthetic_inputs_says_it_has_no_normalisation():
    """data.kind=synthetic trains on standard-normal floats: no pixels, so no mean and std to claim."""
    from gpudl.interop.onnx import classifier_metadata

    meta = classifier_metadata((3, 32, 32), None, None)
    assert meta["normalisation"].startswith("none") and "mean" not in meta and "std" not in meta
    assert json.loads(meta["input_shape"]) == [-1, 3, 32, 32]


def test_triton_config_names_the_graphs_inputs_outputs_and_shapes(exported):
    """config.pbtxt parsed as protobuf text against Triton's ModelConfig fields (model_config.proto, the part
    written here), then compared with the ONNX graph Triton will load from 1/model.onnx."""
    from google.protobuf import text_format

    _, onnx_file, repo, _ = exported
    folder = repo / "resnet18"
    assert (folder / "1" / "model.onnx").read_bytes() == onnx_file.read_bytes()
    model_config = _model_config_class()
    with pytest.raises(text_format.ParseError):  # the negative control: a misspelt field is refused
        text_format.Parse("max_batch: 8", model_config())
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config())
    assert config.name == folder.name and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size >= 8 and config.HasField("dynamic_batching")
    graph = onnx.load(str(folder / "1" / "model.onnx")).graph
    types = {onnx.TensorProto.FLOAT: "TYPE_FP32"}
    type_name = config.DESCRIPTOR.file.enum_types_by_name["DataType"].values_by_number
    for entries, tensors in ((config.input, graph.input), (config.output, graph.output)):
        assert [e.name for e in entries] == [t.name for t in tensors]
        for e, t in zip(entries, tensors):
            assert _dims(t)[0] == -1 and list(e.dims) == _dims(t)[1:]  # Triton adds the batch axis itself
            assert type_name[e.data_type].name == types[t.type.tensor_type.elem_type]
    assert list(config.input[0].dims) == [3, 16, 16] and len(config.output[0].dims) == 1


def test_a_gpt_run_is_refused_in_one_line_naming_format_hf(tmp_path, capsys):
    gpt = ["train.max_steps=2", "train.batch_size=4", "train.eval_every=0", "model.n_layer=1", "model.d_model=32",
           "model.n_head=2", "model.block_size=32", "sample.tokens=0", "log.progress=false", "run.device=cpu",
           "train.precision=fp32", "train.compile=false", "train.time_budget_s=0", "checkpoint.every=2",
           f"run.dir={tmp_path / 'runs'}", "run.name=g"]
    assert main(["train", *_sets(gpt)]) == 0
    capsys.readouterr()
    code, err = main(["export", str(tmp_path / "runs" / "g"), "--format", "onnx"]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--format hf" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "g" / "model.onnx").exists()


@pytest.mark.parametrize("extra, words", [
    (["--triton-repo", "repo"], "add --format onnx"),                       # the default format is gpudl's
    (["--format", "hf", "--triton-repo", "repo"], "add --format onnx"),
    (["--format", "onnx", "--out", "."], "is a folder"),
])
def test_bad_input_is_one_line_and_exit_2(exported, tmp_path, monkeypatch, capsys, extra, words):
    monkeypatch.chdir(tmp_path)
    run = exported[0]
    code, err = main(["export", str(run), *extra]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err and "Traceback" not in err
    assert not (tmp_path / "repo").exists()


def _dims(value) -> list[int]:
    """A graph tensor's shape, -1 for a named (dynamic) axis."""
    return [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]


def _model_config_class():
    """The part of Triton's ModelConfig that gpudl writes, with the field names, numbers and types of
    triton-inference-server/common protobuf/model_config.proto; text_format refuses any other field."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="gpudl_test_model_config.proto", package="inference",
                                              syntax="proto3")
    data_type = file.enum_type.add(name="DataType")
    for number, name in enumerate(["INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                                   "INT32", "INT64", "FP16", "FP32", "FP64", "STRING", "BF16"]):
        data_type.value.add(name=f"TYPE_{name}", number=number)

    def message(name, fields):
        m = file.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            m.field.add(name=field_name, number=number, type=kind, label=label, **({"type_name": type_name}
                                                                                 if type_name else {}))

    one, many = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    tensor = [("name", 1, F.TYPE_STRING, one, None), ("data_type", 2, F.TYPE_ENUM, one, ".inference.DataType")]
    message("ModelInput", [*tensor, ("dims", 4, F.TYPE_INT64, many, None)])
    message("ModelOutput", [*tensor, ("dims", 3, F.TYPE_INT64, many, None)])
    message("ModelDynamicBatching", [("preferred_batch_size", 1, F.TYPE_INT32, many, None),
                                     ("max_queue_delay_microseconds", 2, F.TYPE_UINT64, one, None)])
    message("ModelConfig", [("name", 1, F.TYPE_STRING, one, None), ("platform", 2, F.TYPE_STRING, one, None),
                            ("max_batch_size", 4, F.TYPE_INT32, one, None),
                            ("input", 5, F.TYPE_MESSAGE, many, ".inference.ModelInput"),
                            ("output", 6, F.TYPE_MESSAGE, many, ".inference.ModelOutput"),
                            ("dynamic_batching", 11, F.TYPE_MESSAGE, one, ".inference.ModelDynamicBatching")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("inference.ModelConfig"))
