"""A `gpudl.fit` run served: the fit leaves `model.onnx` beside its weights, `gpudl serve RUN` (a real
process on loopback) runs it with onnxruntime behind the same dynamic batching a ResNet gets, and every
answer is the returned module's own output. A fit whose module cannot be exported says why, and serving
or exporting its folder is one line that says what would make it servable."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gpudl
from conftest import run_cli
from gpudl.cli import main
from test_http import Server, _free_port, _metric

pytest.importorskip("onnxscript")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
tritonclient_http = pytest.importorskip("tritonclient.http")

QUIET = dict(progress=False, device="cpu")


class _DictModule(torch.nn.Module):
    """A module whose batches are dicts: keyword inputs, which serving does not take yet."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """(run folder, the module fit returned, what the fit printed)."""
    torch.manual_seed(0)
    x, y = torch.randn(96, 16), torch.randint(0, 4, (96,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    run, printed = tmp_path_factory.mktemp("fit") / "run", io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = gpudl.fit(model, (x, y), loss=F.cross_entropy, max_steps=3, batch_size=16, lr=1e-2, run_dir=run,
                           **QUIET)
    return run, result.model.eval(), printed.getvalue()


@pytest.fixture(scope="module")
def dict_run(tmp_path_factory):
    """(run folder, what the fit printed) of a fit on dict batches: no model.onnx."""
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    batches = [{"x": x[i:i + 8], "labels": y[i:i + 8]} for i in range(0, 32, 8)]
    run, printed = tmp_path_factory.mktemp("fit-dict") / "run", io.StringIO()
    with contextlib.redirect_stdout(printed):
        gpudl.fit(_DictModule(), batches, loss=F.cross_entropy, max_steps=2, run_dir=run, **QUIET)
    return run, printed.getvalue()


@pytest.fixture(scope="module")
def mlp_server(mlp_run):
    server = Server(mlp_run[0], "--max-batch-size", "8", "--max-queue-delay-ms", "200")
    yield server
    server.stop()


def test_a_fit_leaves_an_onnx_graph_of_its_module_with_where_it_came_from(mlp_run):
    run, _, printed = mlp_run
    graph = onnx.load(str(run / "model.onnx"))
    meta = {p.key: p.value for p in graph.metadata_props}
    assert meta["source"] == "gpudl.fit" and meta["gpudl_fit_model"] == "torch.nn.modules.container.Sequential"
    assert [v.name for v in graph.graph.input] == ["input"] and [v.name for v in graph.graph.output] == ["output"]
    assert f"Model for serving: {run / 'model.onnx'}" in printed


def test_gpudl_serve_batches_a_fit_runs_graph_and_answers_as_the_module_does(mlp_server, mlp_run):
    model, url = mlp_run[1], mlp_server.url
    client = tritonclient_http.InferenceServerClient(url[7:], concurrency=4)
    assert client.is_model_ready("Sequential")
    meta = client.get_model_metadata("Sequential")
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}]

    def ask(x: np.ndarray, binary: bool):
        given = tritonclient_http.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=binary)
        return client.async_infer("Sequential", [given], outputs=[
            tritonclient_http.InferRequestedOutput("output", binary_data=not binary)])

    alone = [np.random.default_rng(n).standard_normal((n, 16), dtype=np.float32) for n in (1, 5)]
    together = [np.random.default_rng(10 + i).standard_normal((n, 16), dtype=np.float32)
                for i, n in enumerate((1, 3, 2, 2))]
    answers = [ask(x, i % 2 == 1).get_result().as_numpy("output") for i, x in enumerate(alone)]
    calls, rows = _metric(url, "gpudl:batch_size_count"), _metric(url, "gpudl:batch_size_sum")
    pending = [ask(x, i % 2 == 0) for i, x in enumerate(together)]  # queued within the 200 ms window
    answers += [p.get_result().as_numpy("output") for p in pending]
    assert _metric(url, "gpudl:batch_size_count") == calls + 1 and _metric(url, "gpudl:batch_size_sum") == rows + 8
    with torch.no_grad():
        for x, got in zip([*alone, *together], answers):
            want = model(torch.from_numpy(x)).numpy()
            assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5


def test_a_request_of_the_wrong_shape_is_400_naming_the_input(mlp_server):
    import httpx

    body = b'{"inputs": [{"name": "input", "shape": [1, 8], "datatype": "FP32", "data": [0,0,0,0,0,0,0,0]}]}'
    answer = httpx.post(mlp_server.url + "/v2/models/Sequential/infer", content=body)
    assert answer.status_code == 400 and "input" in answer.json()["error"] and "16" in answer.json()["error"]


def test_gpudl_export_copies_a_fit_runs_graph_and_lays_it_out_for_triton(mlp_run, tmp_path):
    run = mlp_run[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["export", str(run), "--format", "onnx", "--out", str(tmp_path / "m.onnx"),
                     "--triton-repo", str(tmp_path / "repo")]) == 0
    assert (tmp_path / "m.onnx").read_bytes() == (run / "model.onnx").read_bytes()
    config = (tmp_path / "repo" / "Sequential" / "config.pbtxt").read_text()
    assert 'name: "input"' in config and 'name: "output"' in config and "dims: [ 16 ]" in config
    assert (tmp_path / "repo" / "Sequential" / "1" / "model.onnx").is_file()


def test_a_dict_batch_fit_leaves_no_graph_and_its_folder_is_refused_in_one_line(dict_run, capsys):
    run, printed = dict_run
    assert (run / "model.safetensors").is_file() and not (run / "model.onnx").exists()
    said = [line for line in printed.splitlines() if "model.onnx" in line]
    assert len(said) == 1 and "dicts" in said[0] and "(input, target)" in said[0], printed
    served = run_cli("serve", str(run), "--port", str(_free_port()), "--device", "cpu", timeout=120)
    lines = served.stderr.strip().splitlines()
    assert served.returncode == 2 and len(lines) == 1, served.stderr
    assert "without model.onnx" in lines[0] and "loss=" in lines[0]
    capsys.readouterr()
    assert main(["export", str(run), "--format", "onnx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without model.onnx" in err[0]


def test_a_graph_linked_from_outside_the_run_is_refused(mlp_run, tmp_path):
    import shutil

    from gpudl.errors import UserError
    from gpudl.serve.load import load_model

    run = tmp_path / "run"
    shutil.copytree(mlp_run[0], run, ignore=shutil.ignore_patterns("model.onnx", "checkpoints"))
    shutil.copyfile(mlp_run[0] / "model.onnx", tmp_path / "elsewhere.onnx")
    (run / "model.onnx").symlink_to(tmp_path / "elsewhere.onnx")
    with pytest.raises(UserError, match="outside the model folder"):
        load_model(str(run), device="cpu")
