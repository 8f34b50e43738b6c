"""Text as people have it: folders of text files, JSON Lines, Parquet and datasets saved by Hugging
Face `datasets`, read into the same token windows; every kind of bad input is one line naming the
file and where in it. The expected documents are what each test wrote, read back with nothing of
gpudl's; the Parquet and Arrow files are written by pyarrow and `datasets` themselves."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import TINY, run_cli
from gpudl import models
from gpudl.config import DataConfig
from gpudl.data import build_data
from gpudl.data.text.tokens import text_tokens
from gpudl.data.text.sources import documents, find_corpus
from gpudl.errors import UserError

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402  (after the skip: an optional extra)

GPT = models.resolve("gpt-tiny", {"block_size": 16})
DOCS = ["Zürich café, naïve — 世界 🙂\nsecond line", "plain ascii text " * 20, "third\n\n\ndocument\n"]


def read_all(path, field="text") -> list[str]:
    corpus = find_corpus(str(path), field)
    return [doc for source in corpus.sources for doc in documents(source, field)]


def bytes_tokens(path, field="text") -> bytes:
    """The token file that data.tokenizer=bytes trains on, as bytes."""
    made = text_tokens(DataConfig(kind="text", path=str(path), text_field=field, tokenizer="bytes"), 256, show=False)
    return bytes(np.asarray(made.stream.tokens))


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def test_jsonl_documents_are_its_lines_text_field_and_become_byte_windows(tmp_path):
    f = tmp_path / "docs.jsonl"
    write_jsonl(f, [{"id": i, "body": d} for i, d in enumerate(DOCS)])
    assert read_all(f, "body") == DOCS
    # bytes: each document's UTF-8 without its trailing newlines, then a blank line (as text files have always been)
    assert bytes_tokens(f, "body") == b"".join(d.rstrip("\n").encode() + b"\n\n" for d in DOCS)
    data = build_data(DataConfig(kind="text", path=str(f), text_field="body", tokenizer="bytes"), GPT, 2, seed=0)
    x, y = data.train.batch(0)
    assert x.shape == (2, 16) and (x[:, 1:] == y[:, :-1]).all()


def test_parquet_is_read_row_group_by_row_group_in_order(tmp_path):
    texts = [f"row {i}: " + "ü" * (i % 7) for i in range(1000)]
    table = pa.table({"n": list(range(1000)), "content": texts})
    pq.write_table(table, tmp_path / "part.parquet", row_group_size=128)
    assert pq.ParquetFile(tmp_path / "part.parquet").num_row_groups == 8  # several groups, really
    assert read_all(tmp_path / "part.parquet", "content") == texts


def test_a_saved_hugging_face_dataset_and_the_train_split_of_a_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_dict({"text": DOCS, "label": [0, 1, 2]})
    held = datasets.Dataset.from_dict({"text": ["validation only"], "label": [9]})
    train.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": train, "validation": held}).save_to_disk(str(tmp_path / "both"))
    assert read_all(tmp_path / "one") == DOCS
    assert read_all(tmp_path / "both") == DOCS  # the train split; the user's validation split is not trained on
    assert "train split" in find_corpus(str(tmp_path / "both")).what


def test_a_mixed_folder_reads_text_by_suffix_and_counts_what_it_skips(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "sub" / "b.md").write_text(DOCS[1])
    write_jsonl(tmp_path / "sub" / "c.jsonl", [{"text": DOCS[2]}])
    pq.write_table(pa.table({"text": ["from parquet"]}), tmp_path / "d.parquet")
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    (tmp_path / "blob.txt").write_bytes(b"abc\x00def")                       # NUL: binary under a text name
    (tmp_path / ".hidden.txt").write_text("never read")                     # hidden: not the user's text
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD.txt").write_text("never read either")
    corpus = find_corpus(str(tmp_path))
    assert read_all(tmp_path) == [DOCS[0], "from parquet", DOCS[1], DOCS[2]]  # sorted paths: a.txt, d.parquet, sub/...
    assert dict(corpus.skipped) == {".png": 1, "binary": 1}
    made = text_tokens(DataConfig(kind="text", path=str(tmp_path), tokenizer="bytes"), 256, show=False)
    assert "skipped 2 files (.png 1, binary 1)" in made.description


def test_plain_text_files_as_bytes_need_not_be_utf8(tmp_path):
    """Bytes read a file's bytes as they are: Latin-1 text trains on bytes, and only a tokenizer
    that needs characters asks for UTF-8."""
    (tmp_path / "latin1.txt").write_bytes("café crème ".encode("latin-1") * 30)
    assert bytes_tokens(tmp_path) == "café crème ".encode("latin-1") * 30 + b"\n\n"


def _bad_jsonl(tmp_path, lines: list[bytes]):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    return f


BAD = {
    "not json": (lambda t: _bad_jsonl(t, [b'{"text": "ok"}', b'{"text": "unclosed'], ), r"bad\.jsonl:2: not JSON"),
    "missing field": (lambda t: _bad_jsonl(t, [b'{"text": "ok"}', b'{"body": "x", "id": 3}']),
                      r"bad\.jsonl:2: no field 'text' \(the line has 'body', 'id'\).*data\.text_field"),
    "null field": (lambda t: _bad_jsonl(t, [b'{"text": null}']), r"bad\.jsonl:1: field 'text' is null"),
    "not an object": (lambda t: _bad_jsonl(t, [b'{"text": "a"}', b'{"text": "b"}', b'["a list"]']),
                      r"bad\.jsonl:3: a JSON list, not an object"),
    "jsonl not utf-8": (lambda t: _bad_jsonl(t, [b'{"text": "ok"}', b'{"text": "caf\xe9"}']),
                        r"bad\.jsonl:2: not UTF-8 text \(byte 0xe9"),
    "parquet without the column": (
        lambda t: (pq.write_table(pa.table({"body": ["x"], "id": [1]}), t / "p.parquet"), t / "p.parquet")[1],
        r"p\.parquet: no column 'text' \(its columns: body, id\).*data\.text_field"),
    "parquet column not text": (
        lambda t: (pq.write_table(pa.table({"text": [1, 2]}), t / "p.parquet"), t / "p.parquet")[1],
        r"p\.parquet: column 'text' holds int64, not text"),
    "parquet null row": (
        lambda t: (pq.write_table(pa.table({"text": ["a", None, "c"]}), t / "p.parquet"), t / "p.parquet")[1],
        r"p\.parquet: row 1: 'text' is null"),
    "not parquet": (lambda t: (t / "fake.parquet").write_bytes(b"PAR1 but no more") and t / "fake.parquet",
                    r"fake\.parquet: not a Parquet file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_naming_the_file_and_where(tmp_path, case):
    make, words = BAD[case]
    path = make(tmp_path)
    with pytest.raises(UserError, match=words) as err:
        bytes_tokens(path)
    assert "\n" not in str(err.value)


def test_text_that_is_not_utf8_is_named_by_line_where_a_tokenizer_needs_characters(tmp_path):
    pytest.importorskip("tokenizers")
    f = tmp_path / "notes.txt"
    f.write_bytes(b"line one\nline two\nna\xefve\n" * 50)
    cfg = DataConfig(kind="text", path=str(f), tokenizer="bpe")
    with pytest.raises(UserError, match=r"notes\.txt:3: not UTF-8 text \(byte 0xef.*data\.tokenizer=bytes"):
        text_tokens(cfg, 512, show=False)


def _saved_dataset(tmp_path, filename: str):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(folder))
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": filename}]
    (folder / "state.json").write_text(json.dumps(state))
    return folder


@pytest.mark.parametrize("name", ["../outside.arrow", "/etc/passwd", "link.arrow"])
def test_a_dataset_index_that_names_a_file_outside_its_folder_is_refused(tmp_path, name):
    outside = tmp_path / "outside.arrow"
    outside.write_bytes(b"not yours")
    folder = _saved_dataset(tmp_path, name)
    os.symlink(outside, folder / "link.arrow")
    with pytest.raises(UserError, match="lies outside .*a dataset's files stay in its folder"):
        find_corpus(str(folder))


def test_a_dataset_dict_without_a_train_split_says_which_splits_it_has(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_dict({"text": DOCS})
    datasets.DatasetDict({"test": d, "validation": d}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UserError, match="splits test, validation and no 'train': point data.path at one split"):
        find_corpus(str(tmp_path / "dd"))


def test_a_folder_with_no_text_lists_what_it_skipped(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG")
    (tmp_path / "b.bin").write_bytes(b"\x00")
    with pytest.raises(UserError, match=r"holds no text files; skipped 2 files \(.bin 1, .png 1\)"):
        find_corpus(str(tmp_path))


def test_the_cli_gives_one_line_and_exit_2_and_leaves_no_run_folder(tmp_path):
    bad = _bad_jsonl(tmp_path, [b'{"text": "fine"}'] * 3 + [b"{oops"])
    runs = tmp_path / "runs"
    done = run_cli("train", *[f"--set={s}" for s in TINY], f"--set=data.path={bad}", f"--set=run.dir={runs}",
                   "--set=data.tokenizer=bytes")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{bad}:4: not JSON" in lines[0], done.stderr
    assert not runs.exists() or not any(runs.iterdir())
