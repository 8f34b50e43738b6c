"""`model.init_from` with a gpudl run folder or a gpudl export (docs/interop.md): a fine-tune from
the source's weights, with a new optimizer, schedule and step 0, the source's model settings and,
for a GPT, its tokenizer."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from bpe_run import hf_tokenizer
from conftest import TINY
from gpudl.cli import main
from gpudl.config import load_config
from gpudl.run.recipe import train
from gpudl.run.trained import load_trained

FAST = [s for s in TINY if not s.startswith("model.")] + ["sample.tokens=0", "train.eval_every=0"]
TEXT = "The quick brown fox jumps over the lazy dog. Grüße, naïve café.\n" * 80
SHAPE = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.block_size=32"]


def _run(tmp_path, name: str, *sets: str):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    cfg = load_config(None, [*FAST, f"run.dir={tmp_path / 'runs'}", f"run.name={name}", "data.kind=text",
                             f"data.path={text}", *sets])
    return train(cfg, console=Console(quiet=True))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A gpt-tiny run of 4 steps with its own BPE tokenizer and a shape the recipe does not have, and its export."""
    tmp = tmp_path_factory.mktemp("source")
    tok = hf_tokenizer()
    tok.save(str(tmp / "bpe.json"))
    first = _run(tmp, "first", *SHAPE, "train.max_steps=4", f"data.tokenizer={tmp / 'bpe.json'}",
                 f"model.vocab_size={tok.get_vocab_size()}")
    assert main(["export", str(first.run_dir), "--out", str(tmp / "export" / "model.safetensors")]) == 0
    return first.run_dir, tmp / "export"


@pytest.mark.parametrize("kind", ["run folder", "export file", "export folder"])
def test_a_fine_tune_starts_from_the_sources_final_weights_at_step_0(kind, source, tmp_path):
    """The new run, from the default recipe (gpt-tiny, 4 layers, bytes), takes the source's shape and
    tokenizer; before its first step (lr 1e-30 moves no fp32 weight by half an ulp) its weights are
    bit for bit the source's final ones; its step counter starts at 0 (one step: steps == 1, not 5)."""
    run_dir, export = source
    path = {"run folder": run_dir, "export file": export / "model.safetensors", "export folder": export}[kind]
    final = load_trained(run_dir, "cpu")
    assert final.step == 4
    tuned = _run(tmp_path, "tuned", f"model.init_from={path}", "train.max_steps=1", "optim.lr=1e-30",
                 "data.tokenizer=bytes")
    want, got = final.model.state_dict(), tuned.model.state_dict()
    assert got.keys() == want.keys() and tuned.model.cfg.n_layer == 2
    assert all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want)
    assert tuned.summary["steps"] == 1 and [r["step"] for r in tuned.records if r["kind"] == "train"][0] == 1
    assert (tuned.run_dir / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    assert load_config(tuned.run_dir / "config.toml").model.overrides["n_layer"] == 2


def test_it_fine_tunes_and_resumes_without_the_source(source, tmp_path):
    """A fine-tune at a real learning rate saves its own checkpoints and resumes from them."""
    run_dir, _ = source
    tuned = _run(tmp_path, "tune", f"model.init_from={run_dir}", "train.max_steps=4", "optim.lr=1e-2")
    resumed = train(load_config(tuned.run_dir / "config.toml", ["train.max_steps=6"]), resume=tuned.run_dir,
                    console=Console(quiet=True))
    assert resumed.summary["steps"] == 6


BAD = {
    "contradiction": (lambda run, export: run, ["model.n_layer=3"], ["model.n_layer=3 contradicts", "n_layer=2"]),
    "family": (lambda run, export: export, ["model.name=resnet18"], ["holds a gpt", "--set model.name=gpt-tiny"]),
    "no checkpoint": (lambda run, export: _empty_run(export.parent), [], ["without a complete checkpoint"]),
    "empty folder": (lambda run, export: _made(export.parent / "empty"), [], ["has no config.json"]),
}


def _made(folder):
    folder.mkdir(exist_ok=True)
    return folder


def _empty_run(root):
    folder = _made(root / "fresh")
    (folder / "config.toml").write_text("")
    return folder


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line(case, source, tmp_path, capsys):
    where, sets, said = BAD[case]
    assert main(["train", *[f"--set={s}" for s in FAST + sets], f"--set=run.dir={tmp_path}",
                 f"--set=model.init_from={where(*source)}"]) == 2
    err = capsys.readouterr().err.strip()
    assert all(s in err for s in said) and len(err.splitlines()) == 1, err
