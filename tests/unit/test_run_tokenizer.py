"""generate, the end-of-training sample, evaluate and export of a run trained on BPE tokens
(bpe_run.py): every one reads the run's tokenizer.json, checked against the tokenizers library and
a greedy loop of this file's own."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from bpe_run import BLOCK, bpe_run, copy_run, greedy_ids, hf_tokenizer, split_characters
from conftest import run_here
from gpudl.cli import main
from gpudl.errors import UserError

pytest.importorskip("tokenizers")
PROMPT = "Grüße"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return bpe_run(tmp_path_factory.getbasetemp() / "bpe")


@pytest.fixture(scope="module")
def hf():
    return hf_tokenizer()


def _reference(run, hf, n: int) -> tuple[str, list[int]]:
    """The prompt and its greedy continuation, as text (the library's decode) and the new ids."""
    prompt = hf.encode(PROMPT).ids
    new = greedy_ids(run, prompt, n)
    return hf.decode(prompt + new), new


def test_generate_decodes_with_the_runs_tokenizer(run, hf):
    want, new = _reference(run, hf, 20)
    assert split_characters(hf, new) and want.startswith(PROMPT + ", 世界")   # learnt; characters span tokens
    # --top-k 1 draws the most likely token: greedy, whatever the temperature
    # `gpudl generate` in this process (conftest.run_here): the text it prints is the subject, not its process
    out = run_here("generate", str(run), "--prompt", PROMPT, "--tokens", "20", "--top-k", "1", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"


def test_the_sample_after_training_uses_the_runs_tokenizer(run, hf, tmp_path):
    again = copy_run(run, tmp_path / "again")
    done = run_here("train", "--resume", str(again), "--device=cpu", "--set=train.max_steps=152", "--set=sample.tokens=16",
                    f"--set=sample.prompt={PROMPT}", "--set=sample.top_k=1")
    assert done.returncode == 0, done.stderr
    want, _ = _reference(again, hf, 16)   # from the resumed run's newest checkpoint, as the sample was
    assert (again / "sample.txt").read_text() == want


def _evaluate(capsys, monkeypatch, run, bytes_per_token) -> dict:
    """`gpudl evaluate --json` in this process, its data saying `bytes_per_token`."""
    import gpudl.run.trained as trained

    real = trained.load_trained

    def with_bytes_per_token(*args, **kwargs):
        t = real(*args, **kwargs)
        t.data = dataclasses.replace(t.data)
        t.data.bytes_per_token = bytes_per_token
        return t
    monkeypatch.setattr(trained, "load_trained", with_bytes_per_token)
    assert main(["evaluate", str(run), "--json", "--batches", "2", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_evaluate_reports_bits_per_byte_where_bytes_per_token_is_known(run, hf, capsys, monkeypatch):
    val = np.fromfile(run.parent.parent / "tokens.bin", dtype=np.uint16).tolist()
    val = val[int(len(val) * 0.95):]   # data.val_fraction's part: the end of the token file
    per_token = len(hf.decode(val).encode()) / len(val)   # UTF-8 bytes of validation text per token
    assert per_token > 1.05   # not bytes: the formula's division shows
    result = _evaluate(capsys, monkeypatch, run, per_token)
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / math.log(2) / per_token, rel=1e-12)
    assert "bits_per_byte" not in _evaluate(capsys, monkeypatch, run, None)


def test_export_carries_the_tokenizer_and_serving_reads_it(run, hf, tmp_path, capsys):
    from gpudl.serve.load import load_model

    out = tmp_path / "elsewhere" / "m.safetensors"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert (out.parent / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    loaded = load_model(out, device="cpu")
    text = "naïve café → 世界"
    assert loaded.tokenizer.encode(text) == hf.encode(text).ids and loaded.context_length == BLOCK
    # another model's tokenizer.json in the folder: refused when serving, and when exporting into it
    other = hf_tokenizer()
    other.add_tokens(["<extra>"])
    other.save(str(out.parent / "tokenizer.json"))
    with pytest.raises(UserError, match="not the tokenizer"):
        load_model(out, device="cpu")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out.parent / "m2.safetensors")]) == 2
    assert "another model's tokenizer" in capsys.readouterr().err and not (out.parent / "m2.safetensors").exists()
    (out.parent / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="tokenizer.json is missing"):
        load_model(out, device="cpu")


def test_a_byte_level_export_ignores_a_tokenizer_json_beside_it(tmp_path):
    from gpudl import models
    from gpudl.checkpoint import export_safetensors
    from gpudl.data.tokenizer import ByteTokenizer
    from gpudl.serve.load import load_model

    spec = models.resolve("gpt-tiny", {"n_layer": 1, "d_model": 16, "n_head": 2})
    export_safetensors(models.build(spec, torch.device("cpu")), tmp_path / "model.safetensors",
                       {"gpudl_model": spec.name, "config": json.dumps(dataclasses.asdict(spec.config)),
                        "tokenizer": "bytes"})
    hf_tokenizer().save(str(tmp_path / "tokenizer.json"))   # another export's, in the same folder
    assert isinstance(load_model(tmp_path, device="cpu").tokenizer, ByteTokenizer)
