"""data.tokenizer=bpe: a byte-level BPE trained on the training part only, sized to the model, cached;
the token file it makes, checked against the `tokenizers` library's own encoding of each document;
the same file from worker processes; and a run that keeps its tokenizer when it is resumed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TINY, run_here
from gpudl.config import DataConfig, load_config
from gpudl.data.text.bpe import bpe_tokenizer
from gpudl.data.text.tokens import choose_tokenizer, text_tokens
from gpudl.data.text.sources import find_corpus
from gpudl.data.text import token_file as tokenise
from gpudl.data.text.token_file import token_file
from gpudl.data.tokenizer import EOT, ByteTokenizer
from gpudl.errors import UserError

tokenizers = pytest.importorskip("tokenizers")

SECRET = "zqxjvkwplm"   # a word only the validation text holds


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of this test's own, so that what is trained or reused is this test's doing."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(folder))
    return folder


def corpus_folder(tmp_path, docs: int = 40, secret_docs: int = 1):
    """Documents of varied English-like text (about 1.7 kB each); the last `secret_docs` say SECRET
    (0.7 kB each, inside the last 5%: the validation part)."""
    folder = tmp_path / "text"
    folder.mkdir()
    words = "the model reads text and learns which token comes next in every document it sees".split()
    rng = np.random.default_rng(0)
    for i in range(docs):
        body = " ".join(words[j] for j in rng.integers(0, len(words), 300))
        if i >= docs - secret_docs:
            body = f"{SECRET} " * 60
        (folder / f"{i:03d}.txt").write_text(body + "\n")
    return folder


def test_the_bpe_has_the_models_size_ends_documents_and_round_trips_any_text(tmp_path, cache):
    tok = bpe_tokenizer(find_corpus(str(corpus_folder(tmp_path))), 300, val_fraction=0.05, show=False)
    assert tok.vocab_size == 300
    assert tok.eot_id == 0 and tok.decode([0]) == EOT
    for text in ["the model reads", "Grüße, 世界 🙂 \x00\x7f\t\n", "\ud7ff\U0010ffff"]:  # bytes it never saw
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the model reads text")) < len("the model reads text".encode()) / 2  # it merged


def test_the_bpe_never_sees_the_validation_text(tmp_path, cache):
    corpus = find_corpus(str(corpus_folder(tmp_path)))
    held_out = bpe_tokenizer(corpus, 400, val_fraction=0.05, show=False)
    seen = bpe_tokenizer(corpus, 400, val_fraction=0.0, show=False)  # the control: the same text, all trained on
    assert len(seen.encode(" " + SECRET)) == 1          # a word seen 60 times becomes one token
    assert len(held_out.encode(" " + SECRET)) >= 5      # unseen: pieces of bytes and short merges


def test_a_trained_bpe_is_cached_by_corpus_and_size(tmp_path, cache, capsys):
    folder = corpus_folder(tmp_path)
    first = bpe_tokenizer(find_corpus(str(folder)), 300, 0.05, show=True)
    assert "Training a 300-token BPE" in capsys.readouterr().err
    again = bpe_tokenizer(find_corpus(str(folder)), 300, 0.05, show=True)
    assert capsys.readouterr().err == "" and again.digest == first.digest  # read, not trained again
    (folder / "000.txt").write_text("changed text " * 100)  # another corpus: another tokenizer
    bpe_tokenizer(find_corpus(str(folder)), 300, 0.05, show=True)
    assert "Training a 300-token BPE" in capsys.readouterr().err
    bpe_tokenizer(find_corpus(str(folder)), 320, 0.05, show=False)
    assert len(list(cache.glob("bpe-*.json"))) == 3


def test_the_token_file_is_each_documents_encoding_then_end_of_text(tmp_path, cache):
    folder = corpus_folder(tmp_path, docs=20, secret_docs=1)
    cfg = DataConfig(kind="text", path=str(folder), tokenizer="bpe", val_fraction=0.05)
    made = text_tokens(cfg, 512, show=False)
    hf = tokenizers.Tokenizer.from_str(made.tokenizer.json_text)  # the library itself, no gpudl code
    texts = [p.read_text() for p in sorted(folder.glob("*.txt"))]
    sizes = np.cumsum([len(t.encode()) for t in texts])
    cut = int(sizes[-1] * 0.95)  # the last 5% of the text's bytes validate (all ASCII: any byte is a boundary)
    at = int(np.searchsorted(sizes, cut, side="right"))  # the document the cut falls in
    assert 0 < at < len(texts) - 1 and sizes[at - 1] < cut  # inside one, not between two: the hard case
    head, tail = texts[at][:cut - sizes[at - 1]], texts[at][cut - sizes[at - 1]:]
    expected = [i for t in texts[:at] for i in hf.encode(t).ids + [0]] + hf.encode(head).ids
    val = hf.encode(tail).ids + [0] + [i for t in texts[at + 1:] for i in hf.encode(t).ids + [0]]
    val_bytes = len(tail) + sum(len(t) for t in texts[at + 1:])
    tokens = np.asarray(made.stream.tokens)
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected + val
    assert made.stream.split_at == len(expected)
    assert made.bytes_per_token == pytest.approx(val_bytes / len(val))


def test_worker_processes_make_the_same_token_file(tmp_path, cache, monkeypatch):
    folder = corpus_folder(tmp_path, docs=30)
    corpus = find_corpus(str(folder))
    tok = bpe_tokenizer(corpus, 300, 0.05, show=False)
    serial = token_file(corpus, tok, 0.05, show=False, workers=1)
    data = serial.path.read_bytes()
    serial.path.unlink()  # so that the next call makes it again, now in two processes with small chunks
    monkeypatch.setattr(tokenise, "CHUNK_BYTES", 4096)  # many chunks in flight, handed back out of order
    parallel = token_file(find_corpus(str(folder)), tok, 0.05, show=False, workers=2, parallel_from=0)
    assert parallel.path.read_bytes() == data
    assert (parallel.split_at, parallel.tokens) == (serial.split_at, serial.tokens)


def test_auto_is_bpe_for_a_gpt2_sized_vocabulary_and_bytes_for_gpt_tiny(tmp_path, cache):
    corpus = find_corpus(str(corpus_folder(tmp_path)))
    assert isinstance(choose_tokenizer("auto", corpus, 256, 0.05, show=False), ByteTokenizer)
    assert choose_tokenizer("auto", corpus, 300, 0.05, show=False).name == "bpe"
    for recipe in ("gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt-1b"):
        assert load_config(recipe).data.tokenizer in ("bpe", "auto")
        assert load_config(recipe).model.overrides.get("vocab_size", 50304) > 256


def test_a_vocabulary_too_small_for_bpe_or_for_its_tokenizer_says_what_to_set(tmp_path, cache):
    corpus = find_corpus(str(corpus_folder(tmp_path)))
    with pytest.raises(UserError, match="needs model.vocab_size >= 258"):
        choose_tokenizer("bpe", corpus, 256, 0.05, show=False)
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe_tokenizer(corpus, 310, 0.05, show=False).json_text)
    cfg = DataConfig(kind="text", path=str(corpus.sources[0].path.parent), tokenizer=str(path))
    with pytest.raises(UserError, match="has 310 tokens but model.vocab_size=300: set --set model.vocab_size=320"):
        text_tokens(cfg, 300, show=False)
    with pytest.raises(UserError, match="is none of auto, bytes, bpe and not a tokenizer.json"):
        choose_tokenizer("bpee", corpus, 300, 0.05, show=False)


def test_a_resumed_run_reads_its_text_through_the_tokenizer_it_kept(tmp_path, cache):
    folder = corpus_folder(tmp_path)
    runs = tmp_path / "runs"
    sets = [*TINY, f"run.dir={runs}", "run.name=r", f"data.path={folder}", "data.tokenizer=bpe",
            "model.vocab_size=320", "checkpoint.every=3"]
    # `gpudl train` in this process (conftest.run_here): a resumed run's tokenizer is the subject, not its process
    first = run_here("train", *[f"--set={s}" for s in sets])
    assert first.returncode == 0, first.stderr
    assert "Training a 320-token BPE" in first.stderr  # where a BPE trained again would say so below
    kept = (runs / "r" / "tokenizer.json").read_text()
    for trained in cache.glob("bpe-*.json"):
        trained.unlink()  # a resume that trained a BPE again would make it here, and might differ
    more = run_here("train", *[f"--set={s}" for s in sets[:-1]], "--set=train.max_steps=9", "--set=checkpoint.every=3",
                    "--set=data.tokenizer=bytes", f"--resume={runs / 'r'}")  # even told otherwise
    assert more.returncode == 0, more.stderr
    assert "Training a" not in more.stderr and not list(cache.glob("bpe-*.json"))
    assert (runs / "r" / "tokenizer.json").read_text() == kept
    steps = [json.loads(line)["step"] for line in (runs / "r" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps[-1] == 9


def test_a_run_on_json_lines_keeps_its_bpe_and_evaluates_in_bits_per_byte(tmp_path, cache):
    """train -> evaluate -> generate through the real CLI (its parser and commands, in this process:
    conftest.run_here); bits per byte checked against the library's own count of the validation text's tokens."""
    words = "every token of the validation text stands for some bytes of it".split()
    rng = np.random.default_rng(1)
    docs = [" ".join(words[j] for j in rng.integers(0, len(words), 200)) + " ü→" for _ in range(30)]
    f = tmp_path / "corpus.jsonl"
    f.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    runs = tmp_path / "runs"
    done = run_here("train", *[f"--set={s}" for s in TINY], f"--set=run.dir={runs}", "--set=run.name=j",
                    f"--set=data.path={f}", "--set=data.text_field=body", "--set=model.vocab_size=384")
    assert done.returncode == 0, done.stderr
    assert "JSON Lines file, 30 documents" in " ".join(done.stdout.split())  # the start block, however it wraps
    hf = tokenizers.Tokenizer.from_file(str(runs / "j" / "tokenizer.json"))
    assert hf.get_vocab_size() > 256 and hf.token_to_id(EOT) == 0  # auto chose a BPE for a vocabulary over 256
    raw = "".join(docs).encode()
    cut = int(len(raw) * 0.95)
    sizes = np.cumsum([len(d.encode()) for d in docs])
    at = int(np.searchsorted(sizes, cut, side="right"))
    tail = [docs[at].encode()[cut - (sizes[at - 1] if at else 0):].decode()] + docs[at + 1:]
    val_tokens = sum(len(hf.encode(t).ids) + 1 for t in tail)
    ev = run_here("evaluate", str(runs / "j"), "--json", "--device=cpu")
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / np.log(2) / ((len(raw) - cut) / val_tokens))
    gen = run_here("generate", str(runs / "j"), "--prompt", "every token", "--tokens", "8", "--device=cpu")
    assert gen.returncode == 0 and gen.stdout.startswith("every token"), gen.stderr
