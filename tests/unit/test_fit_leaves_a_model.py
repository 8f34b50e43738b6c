"""A `fit` with a run folder leaves its model for other tools: a Hugging Face model as its own
`save_pretrained` folder that `from_pretrained` loads, any other module as `model.safetensors`; in both
the weights are the trained ones (compared with the returned module's, independently read back)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gpudl

QUIET = dict(progress=False, quiet=True, device="cpu")


def test_a_hugging_face_model_comes_back_through_from_pretrained(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=32))
    ids = torch.randint(0, 97, (64, 16), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": ids[i:i + 8], "labels": ids[i:i + 8]} for i in range(0, 64, 8)]
    result = gpudl.fit(model, batches, max_steps=4, lr=1e-2, run_dir=tmp_path / "run", **QUIET)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "model").eval()
    trained = result.model.eval()
    assert not torch.equal(trained.transformer.wte.weight, GPT2LMHeadModel(model.config).transformer.wte.weight)
    with torch.no_grad():
        assert torch.equal(loaded(ids[:4]).logits, trained(ids[:4]).logits)


def test_a_plain_module_leaves_its_weights_as_safetensors(tmp_path):
    from safetensors.torch import load_file

    x, y = torch.randn(128, 8), torch.randint(0, 3, (128,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = gpudl.fit(model, (x, y), loss=F.cross_entropy, max_steps=3, batch_size=32, run_dir=tmp_path / "run",
                       **QUIET)
    saved = load_file(tmp_path / "run" / "model.safetensors")
    assert saved.keys() == before.keys()
    assert all(torch.equal(saved[k], v) for k, v in result.model.state_dict().items())
    assert not all(torch.equal(saved[k], before[k]) for k in before)  # trained, not the initial weights


def test_a_fit_without_a_run_folder_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    gpudl.fit(torch.nn.Linear(4, 2), (x, y), loss=F.cross_entropy, max_steps=2, batch_size=16, **QUIET)
    assert list(tmp_path.iterdir()) == []


def test_commands_on_a_fit_run_say_in_one_line_what_they_need(tmp_path, capsys):
    from gpudl.cli import main

    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    run = tmp_path / "run"
    gpudl.fit(torch.nn.Linear(4, 2), (x, y), loss=F.cross_entropy, max_steps=2, batch_size=16, run_dir=run, **QUIET)
    capsys.readouterr()
    for command, need in [("evaluate", "val_data="), ("generate", "in Python"), ("export", "there already")]:
        assert main([command, str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{run} is a gpudl.fit run" in err and need in err, err
        assert str(run / "model.safetensors") in err
