"""Hugging Face's GPT-2 folder, both ways (docs/interop.md): `gpudl export --format hf` read back by
`transformers`, and `model.init_from` starting a run from a folder `save_pretrained` wrote.

Everything is made here, offline: random-initialised models at small widths. The weights are drawn
wider than GPT-2's initialisation (std 0.2, biases and LayerNorms included), so that a wrong mapping
(q and k swapped, a transpose forgotten, a bias dropped) moves the logits far beyond the 1e-4 allowed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

from bpe_run import hf_tokenizer
from conftest import TINY
from gpudl import models
from gpudl.cli import main
from gpudl.config import load_config
from gpudl.data.tokenizer import ByteTokenizer, FileTokenizer
from gpudl.interop.hf import export_hf
from gpudl.models.gpt import GPT, generate
from gpudl.run.recipe import train
from gpudl.run.trained import load_trained

transformers = pytest.importorskip("transformers")

GPT_RECIPES = ["gpt-tiny", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt-1b"]
TEXT = "Grüße, 世界 🙂! naïve café → done. The quick brown fox jumps over the lazy dog.\n" * 60
FAST = [s for s in TINY if not s.startswith("model.")] + ["sample.tokens=0", "train.eval_every=0"]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread for these tiny models: two spend more time waiting on each other (and on
    whatever else shares the cores) than computing, ten times over for a 48-layer model's generation."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@torch.no_grad()
def _widen(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    for p in model.parameters():
        p.normal_(0.0, 0.2)
    return model.eval()


def _hf(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _greedy_hf(hf, prompt: torch.Tensor, n: int) -> torch.Tensor:
    return hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                       min_new_tokens=n, pad_token_id=0)


@pytest.mark.parametrize("recipe", GPT_RECIPES)
def test_export_of_each_recipe_layout_matches_transformers(recipe, tmp_path):
    """The recipe's own layer layout (depth, heads, context, vocabulary, tied head, no biases) at head
    width 4: the logits equal gpudl's in fp32 and greedy decoding agrees token for token."""
    base = models.from_config(load_config(recipe)).config
    cfg = dataclasses.replace(base, d_model=base.n_head * 4)
    model = _widen(GPT(cfg))
    hf = _hf(export_hf(model, ByteTokenizer(), tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["n_layer"], config["n_positions"]) == \
        (["GPT2LMHeadModel"], "gpt2", cfg.n_layer, cfg.block_size)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() <= 1e-4
    prompt = ids[:1, :4]
    assert torch.equal(_greedy_hf(hf, prompt, 6), generate(model, prompt, 6, temperature=0))


def test_export_with_biases_untied_head_and_other_mlp_width(tmp_path):
    """Every GPTConfig field GPT-2 can say: biases, an untied head (lm_head.weight written,
    tie_word_embeddings false), mlp_ratio 3 (n_inner), dropout (GPT-2's three, off in eval)."""
    cfg = models.gpt.GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=32, vocab_size=300, bias=True,
                               mlp_ratio=3, tie_embeddings=False, dropout=0.1)
    model = _widen(GPT(cfg))
    hf = _hf(export_hf(model, ByteTokenizer(), tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["n_inner"], config["resid_pdrop"]) == (False, 48, 0.1)
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() <= 1e-4


def _run(tmp_path: Path, name: str, *sets: str):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    cfg = load_config(None, [*FAST, f"run.dir={tmp_path / 'runs'}", f"run.name={name}", "data.kind=text",
                             f"data.path={text}", *sets])
    return train(cfg, console=Console(quiet=True))


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_cli_export_of_a_run_loads_with_its_tokenizer(tokenizer, tmp_path, capsys):
    """`gpudl export RUN --format hf`: AutoTokenizer encodes the run's text to the ids the run trained
    on (its UTF-8 bytes, or its BPE), and the model's logits are the run's."""
    sets, eot = ["data.tokenizer=bytes"], None
    if tokenizer == "bpe":  # with <|endoftext|>, as gpudl's own BPE has it: the folder's end-of-text token
        tok = hf_tokenizer()
        eot = tok.add_special_tokens(["<|endoftext|>"]) and tok.token_to_id("<|endoftext|>")
        tok.save(str(tmp_path / "bpe.json"))
        sets = [f"data.tokenizer={tmp_path / 'bpe.json'}", "model.vocab_size=448"]
    result = _run(tmp_path, tokenizer, "model.n_layer=2", "model.d_model=32", "model.n_head=2",
                  "model.block_size=32", *sets)
    assert main(["export", str(result.run_dir), "--format", "hf"]) == 0
    out = result.run_dir / "hf"
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "generation_config.json",
                                               "tokenizer.json", "tokenizer_config.json"}
    run_tok = load_trained(result.run_dir, "cpu").data.tokenizer
    assert isinstance(run_tok, ByteTokenizer if tokenizer == "bytes" else FileTokenizer)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.eos_token_id == eot == json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    sample = TEXT[:90] + " \t\n  x"
    assert auto(sample)["input_ids"] == run_tok.encode(sample) and auto.decode(run_tok.encode(sample)) == sample
    ids = torch.tensor([run_tok.encode(sample)[:32]])
    with torch.no_grad():
        assert (_hf(out)(ids).logits - load_trained(result.run_dir, "cpu").model(ids)).abs().max() <= 1e-4


def _gpt2_folder(folder: Path, tied: bool) -> Path:
    """A random GPT2LMHeadModel with non-zero biases, saved by save_pretrained, with a BPE tokenizer:
    tokenizer.json (tied) or GPT-2's vocab.json + merges.txt (untied)."""
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=400,
                                     tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    _widen(transformers.GPT2LMHeadModel(config), seed=3).save_pretrained(folder)
    tok = hf_tokenizer()
    tok.save(str(folder / "tokenizer.json")) if tied else tok.model.save(str(folder))
    return folder


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_init_from_a_gpt2_folder_and_back(tied, tmp_path):
    """model.init_from: the model before step 1 is transformers' (logits; lr 1e-30 moves no fp32 weight
    by half an ulp, so one step leaves them as they came), exported back the weights are the folder's
    bit for bit, the folder's tokenizer is the run's, a fine-tune's loss falls, and it resumes without
    the folder."""
    folder = _gpt2_folder(tmp_path / "gpt2", tied)
    start = _run(tmp_path, "start", f"model.init_from={folder}", "train.max_steps=1", "optim.lr=1e-30")
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (_hf(folder)(ids).logits - start.model.eval()(ids)).abs().max() <= 1e-4
    assert main(["export", str(start.run_dir), "--format", "hf", "--out", str(tmp_path / "back")]) == 0
    came, went = _tensors(folder / "model.safetensors"), _tensors(tmp_path / "back" / "model.safetensors")
    assert came.keys() == went.keys()
    assert all(torch.equal(came[k].view(torch.int32), went[k].view(torch.int32)) for k in came)
    assert load_trained(start.run_dir, "cpu").data.tokenizer.encode(TEXT[:80]) == hf_tokenizer().encode(TEXT[:80]).ids
    tuned = _run(tmp_path, "tune", f"model.init_from={folder}", "train.max_steps=20", "optim.lr=1e-2",
                 "optim.warmup_steps=2")
    losses = [r["loss"] for r in tuned.records if r["kind"] == "train"]
    assert losses[-1] < 0.8 * losses[0]
    shutil.rmtree(folder)  # a resumed run continues from its checkpoint and tokenizer, never the folder
    resumed = train(load_config(tuned.run_dir / "config.toml", ["train.max_steps=22"]), resume=tuned.run_dir,
                    console=Console(quiet=True))
    assert resumed.summary["steps"] == 22


@pytest.fixture
def gpt2_folder(tmp_path):
    return _gpt2_folder(tmp_path / "gpt2", tied=True)


def test_the_other_weight_files_read_as_model_safetensors(gpt2_folder, tmp_path):
    """Shards (model.safetensors.index.json) and a pytorch_model.bin in the original GPT-2 naming (no
    "transformer." prefix, the causal-mask buffers, the tied head's copy) give the same weights."""
    from gpudl.interop.hf import read_gpt2_folder

    want = read_gpt2_folder(gpt2_folder).state
    sharded = tmp_path / "sharded"
    _hf(gpt2_folder).save_pretrained(sharded, max_shard_size="20KB")
    shutil.copy(gpt2_folder / "tokenizer.json", sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(gpt2_folder / "config.json", old)
    state = {k.removeprefix("transformer."): v for k, v in _tensors(gpt2_folder / "model.safetensors").items()}
    torch.save({**state, "lm_head.weight": state["wte.weight"], "h.0.attn.bias": torch.ones(1, 1, 32, 32)},
               old / "pytorch_model.bin")
    for folder in (sharded, old):
        got = read_gpt2_folder(folder).state
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


BAD = {
    "missing folder": (lambda f: shutil.rmtree(f), "the folder does not exist"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
    "architecture": (lambda f: _edit_config(f, architectures=["LlamaForCausalLM"]),
                     "describes LlamaForCausalLM, not GPT2LMHeadModel"),
    "activation": (lambda f: _edit_config(f, activation_function="relu"), "activation_function='relu'"),
    "shape": (lambda f: _edit_config(f, vocab_size=401), "transformer.wte.weight in"),
    "pickle": (lambda f: ((f / "model.safetensors").unlink(),
                          torch.save({"made": datetime.datetime(2026, 1, 1)}, f / "pytorch_model.bin")),
               "torch.load(weights_only=True) refuses"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_init_from_is_one_line(case, gpt2_folder, capsys):
    """Each bad folder stops `gpudl train` before anything runs: exit 2, one line that says what."""
    damage, said = BAD[case]
    damage(gpt2_folder)
    assert main(["train", *[f"--set={s}" for s in FAST], f"--set=model.init_from={gpt2_folder}"]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err


def test_a_set_that_contradicts_the_folder_is_named(gpt2_folder, capsys):
    assert main(["train", *[f"--set={s}" for s in FAST], f"--set=model.init_from={gpt2_folder}",
                 "--set=model.n_layer=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.n_layer=3 contradicts" in err and "n_layer=2" in err and len(err.splitlines()) == 1, err


def test_export_refuses_a_gelu_gpt2_does_not_have(tmp_path, monkeypatch, capsys):
    result = _run(tmp_path, "gelu", "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.block_size=16",
                  "train.max_steps=1")
    monkeypatch.setattr(models.gpt, "GELU_APPROXIMATE", "none")
    assert main(["export", str(result.run_dir), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "gelu_new" in err and len(err.splitlines()) == 1, err
