"""A run folder of a GPT trained on BPE tokens, for the tests of what reads a run's text: a byte-level
BPE `tokenizer.json` trained here with Hugging Face tokenizers, a token file of one sentence encoded
with it, a short real training run (`gpudl train`) that learns the sentence by heart, and the
tokenizer kept in the run folder as training keeps it.

The sentence's accented letters, CJK characters and emoji are rare in the tokenizer's corpus, so
BPE leaves them as byte tokens: one character's UTF-8 bytes span several tokens. The references
the tests compare with are computed here, without gpudl's tokenizer or generation code: the
`tokenizers` library's own encode and decode, and a greedy loop over the model with no cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from conftest import run_here

SENTENCE = "Grüße, 世界 🙂! naïve café → done.\n"
BLOCK = 64
VOCAB = 400
_made: dict[str, Path] = {}


def hf_tokenizer():
    """A byte-level BPE (ByteLevel pre-tokenizer and decoder, all 256 bytes in its alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = Path(__file__).with_name("conftest.py").read_text() + SENTENCE * 3
    tok.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert tok.get_vocab_size() == VOCAB
    return tok


def bpe_run(root: Path) -> Path:
    """The run folder (made once per test session; copy it before changing it)."""
    if "run" in _made:
        return _made["run"]
    root.mkdir(parents=True, exist_ok=True)
    tok = hf_tokenizer()
    np.array(tok.encode(SENTENCE * 400).ids, dtype=np.uint16).tofile(root / "tokens.bin")
    # `gpudl train` in this process (conftest.run_here): the run is what the tests read, not its process
    done = run_here("train", "--device=cpu", f"--set=run.dir={root / 'runs'}", "--set=run.name=bpe",
                    "--set=data.kind=tokens", f"--set=data.path={root / 'tokens.bin'}", f"--set=model.vocab_size={VOCAB}",
                    "--set=model.n_layer=2", "--set=model.d_model=64", "--set=model.n_head=2",
                    f"--set=model.block_size={BLOCK}", "--set=train.batch_size=8", "--set=train.max_steps=150",
                    "--set=optim.lr=3e-3", "--set=train.precision=fp32", "--set=train.compile=false",
                    "--set=train.eval_every=0", "--set=train.time_budget_s=0", "--set=log.progress=false",
                    "--set=sample.tokens=0")
    assert done.returncode == 0, done.stderr
    run = root / "runs" / "bpe"
    tok.save(str(run / "tokenizer.json"))  # where training keeps the tokenizer it trained with
    _made["run"] = run
    return run


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def greedy_ids(run: Path, prompt_ids: list[int], n: int) -> list[int]:
    """The run's newest checkpoint continued greedily by up to n tokens (until the context is full),
    the whole sequence through the model for every token."""
    from gpudl.run.trained import load_trained

    model, ids = load_trained(run, "cpu").model, list(prompt_ids)
    with torch.no_grad():
        while len(ids) - len(prompt_ids) < n and len(ids) < BLOCK:
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


def split_characters(tok, ids: list[int]) -> list[str]:
    """The characters of decode(ids) whose UTF-8 bytes lie in more than one token."""
    text, split = tok.decode(ids), []
    for i in range(1, len(ids)):
        before = tok.decode(ids[:i])  # ends with U+FFFD where token i-1 ends inside a character
        if before.endswith("\ufffd") and text[len(before) - 1] != "\ufffd":
            split.append(text[len(before) - 1])
    return split
