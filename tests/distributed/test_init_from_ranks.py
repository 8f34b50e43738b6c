"""model.init_from on real processes: a Hugging Face GPT-2 folder is read once and placed as a
checkpoint is, so every layout (DDP, FSDP2, tensor and pipeline parallel) trains exactly as one
process does from the same folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from bodies import on
from gpudl.config import load_config
from gpudl.run.recipe import train
from helper import need_devices, run_ranks, tolerance

transformers = pytest.importorskip("transformers")

# Four untied layers with biases (as every real GPT-2 has): each layout below can hold them, the
# pipeline's two stages included. TINY's other settings: d_model 32, 2 heads, 32 positions, bytes.
MODEL = ["model.n_layer=4", "model.tie_embeddings=false", "train.max_steps=4", "train.eval_every=0",
         "optim.lr=1e-3"]


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> Path:
    """A GPT2LMHeadModel of TINY's width with weights drawn at std 0.2 (a wrong mapping shows), saved by
    save_pretrained; no tokenizer, so the run reads bytes as TINY does."""
    folder = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(n_layer=4, n_head=2, n_embd=32, n_positions=32, vocab_size=256,
                                     tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


_references: dict[int, dict] = {}


def reference(tmp_path_factory, folder: Path, batch: int) -> dict:
    """One process from the same folder with the whole batch: what each layout must reproduce."""
    if batch not in _references:
        run_dir = tmp_path_factory.mktemp(f"ref{batch}")
        cfg = load_config(None, on("cpu", [*MODEL, f"model.init_from={folder}", f"train.batch_size={batch}",
                                           f"run.dir={run_dir}", "run.name=ref"]))
        result = train(cfg, console=Console(quiet=True))
        _references[batch] = {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
                              "params": {k: v.detach().cpu() for k, v in result.model.state_dict().items()}}
    return _references[batch]


# The layout's settings; the reference's batch (a data-parallel pair of ranks sees twice TINY's 4); how
# the ranks report the whole model (a pipeline's stages hold different parameters: train_gathered).
LAYOUTS = {"ddp": (["parallel.dp_replicate=2"], 8, "train_tiny"), "fsdp": (["parallel.dp_shard=2"], 8, "train_tiny"),
           "tp": (["parallel.tp=2"], 4, "train_tiny"),
           "pp": (["parallel.pp=2", "parallel.pp_schedule=gpipe"], 4, "train_gathered")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_from_trains_as_one_process_in_every_layout(layout, gpt2_folder, tmp_path, tmp_path_factory):
    need_devices("cpu", 2)
    sets, batch, body = LAYOUTS[layout]
    want = reference(tmp_path_factory, gpt2_folder, batch)
    ranks = run_ranks(body, 2, tmp_path, "cpu",
                      sets=[*MODEL, *sets, f"model.init_from={gpt2_folder}", f"run.dir={tmp_path}/runs",
                            f"run.name={layout}"])
    assert ranks[0]["losses"] == ranks[1]["losses"]
    got = ranks[0]
    assert got["losses"].keys() == want["losses"].keys() and got["params"].keys() == want["params"].keys()
    for step, loss in want["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=tolerance("cpu")), f"loss at step {step}"
    for name, p in want["params"].items():
        # A key's bias has no gradient in exact arithmetic (softmax ignores a shift shared by every key), so
        # Adam turns each process's rounding noise into steps of up to lr: within 4 steps x lr, no closer.
        atol = 4 * 1e-3 + 1e-6 if name.endswith("attn.wk.bias") else tolerance("cpu")
        assert torch.allclose(got["params"][name], p, atol=atol, rtol=0), name
    # and the reference did start from the folder: 4 Adam steps of 1e-3 moved its positions by no more
    # than that from the folder's (weights drawn at std 0.2; a random start's are at 0.02)
    from safetensors.torch import load_file
    came = load_file(str(gpt2_folder / "model.safetensors"))["transformer.wpe.weight"]
    assert (want["params"]["wpe.weight"] - came).abs().max() <= 4 * 1e-3 + 1e-6
