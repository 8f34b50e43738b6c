"""gpudl bench --scaling: the process counts, a real one-point study, its files."""

import json

from test_bench import md_tables, png_size

from gpudl.bench.scaling import process_counts, run_scaling, write_scaling
from gpudl.cli import main

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.block_size=16", "train.batch_size=2"]


def test_process_counts_double_up_to_the_limit():
    assert process_counts(1) == [1]
    assert process_counts(2) == [1, 2]
    assert process_counts(6) == [1, 2, 4, 6]
    assert process_counts(8) == [1, 2, 4, 8]


def test_a_real_study_writes_json_markdown_and_a_plot(tmp_path):
    doc = run_scaling(model="gpt-tiny", sets=TINY, device="cpu", max_procs=1, steps=20, repeats=1)
    (point,) = doc["points"]
    assert point["processes"] == 1 and point["samples_per_s"] > 0 and point["efficiency"] == 1.0
    # what two points would look like, to check the files (a second real run would only repeat the launcher tests)
    doc["points"].append({"processes": 2, "samples_per_s": 1.6 * point["samples_per_s"], "runs": [],
                          "efficiency": 0.8})
    written = write_scaling(doc, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "scaling.json").read_text())["points"][1]["efficiency"] == 0.8
    (table,) = md_tables((tmp_path / "out" / "scaling.md").read_text())
    assert table[0] == ["processes", "samples/s", "speed-up", "efficiency"] and table[3][3] == "80%"
    assert png_size(tmp_path / "out" / "scaling.png")[0] > 100 and len(written) == 3


def test_scaling_takes_one_model(capsys, tmp_path):
    assert main(["bench", "--scaling", "--model", "gpt-tiny", "--model", "resnet18", "--out", str(tmp_path)]) == 2
    assert "one model on one kind of device" in capsys.readouterr().err
