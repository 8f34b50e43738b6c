"""Documents to a token file: tokenised once, in worker processes, into a memory-mapped file in the cache.

The file holds each document's tokens followed by the end-of-text token (a tokenizer without one,
as bytes: the document's text ends in a blank line instead). The last `val_fraction` of the text,
by UTF-8 bytes, is the validation part: its tokens come after the training part's, the BPE trainer
never sees it (`bpe.py`), and a document it cuts is cut on a character boundary.

The file is uint8 for a vocabulary of 256, uint16 up to 65,536, else uint32, written under a temporary
name and renamed when whole; beside it, JSON with where validation starts and how many bytes of text
its tokens stand for. Its name is a digest of the sources (paths, sizes, times), the tokenizer's
digest and the split: any change makes another file, never a stale one.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...cache import atomic_file, cache_dir, write_atomically
from ...errors import UserError
from .cache import WorkBar, cache_key, cache_lock
from .sources import Corpus, documents
from ..tokenizer import FileTokenizer, Tokenizer

FORMAT = 1              # bump when the way documents become a token file changes
CHUNK_BYTES = 1 << 20   # text per work item: big enough that a worker's round trip is noise
PARALLEL_FROM = 4 << 20  # less text than this is tokenised in this process: workers take a second to start


@dataclass(frozen=True)
class Piece:
    text: str
    ends_document: bool   # False for the training half of the document the split cuts
    val: bool
    n_bytes: int


def document_texts(corpus: Corpus, with_eot: bool) -> Iterator[str]:
    """Each document's text; without an end-of-text token, with the blank line that ends it instead
    (as the byte corpus of text files has always been made)."""
    for source in corpus.sources:
        for doc in documents(source, corpus.text_field):
            text = doc if with_eot else doc.rstrip("\n")
            if text:
                yield text if with_eot else text + "\n\n"


def text_size(corpus: Corpus, with_eot: bool) -> tuple[int, int]:
    """(documents, UTF-8 bytes of their text): a first pass, which finds bad input before any long work."""
    if with_eot not in corpus.sizes:
        docs = n_bytes = 0
        for text in document_texts(corpus, with_eot):
            docs, n_bytes = docs + 1, n_bytes + len(text.encode("utf-8"))
        if not n_bytes:
            raise UserError(f"data.path {corpus.path_label!r} holds no text (only empty documents): add text")
        corpus.sizes[with_eot] = (docs, n_bytes)
    return corpus.sizes[with_eot]


def split_byte(total: int, val_fraction: float) -> int:
    """Where validation starts: the same rule as a token file's (`TokenStream`)."""
    return int(total * (1.0 - val_fraction))


def pieces(corpus: Corpus, with_eot: bool, val_fraction: float) -> Iterator[Piece]:
    cut, seen = split_byte(text_size(corpus, with_eot)[1], val_fraction), 0
    for text in document_texts(corpus, with_eot):
        raw = text.encode("utf-8")
        if seen + len(raw) <= cut or seen >= cut:
            yield Piece(text, True, seen >= cut, len(raw))
        else:  # the document the split falls in: its head trains, its tail validates
            at = cut - seen
            while at > 0 and raw[at] & 0xC0 == 0x80:  # not inside a character
                at -= 1
            if at:
                yield Piece(raw[:at].decode("utf-8"), False, False, at)
            yield Piece(raw[at:].decode("utf-8"), True, True, len(raw) - at)
        seen += len(raw)


def training_texts(corpus: Corpus, val_fraction: float) -> Iterator[str]:
    """The text a tokenizer may be trained on: the training part only."""
    return (p.text for p in pieces(corpus, True, val_fraction) if not p.val)


def token_dtype(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65_536 else "uint32"


@dataclass
class TokenFile:
    path: Path
    dtype: str
    split_at: int       # tokens before validation's
    documents: int
    tokens: int
    val_tokens: int
    val_bytes: int      # UTF-8 bytes of the validation text

    @property
    def bytes_per_token(self) -> float | None:
        return self.val_bytes / self.val_tokens if self.val_tokens else None


def token_file(corpus: Corpus, tokenizer: Tokenizer, val_fraction: float, show: bool = True,
               workers: int | None = None, parallel_from: int = PARALLEL_FROM) -> TokenFile:
    """The token file of `corpus` through `tokenizer`, made once (in `workers` processes, default one
    per usable core, where there are `parallel_from` bytes of text or more) and then read from the cache."""
    dtype = token_dtype(tokenizer.vocab_size)
    key = cache_key(FORMAT, corpus.fingerprint, tokenizer.digest, val_fraction)
    out = cache_dir() / f"tokens-{corpus.label}-{key}.{dtype}"
    with cache_lock(out):
        made = _made(out, dtype)
        if made is None:
            made = _write(corpus, tokenizer, val_fraction, out, dtype, show, workers, parallel_from)
    return made


def _meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def _made(out: Path, dtype: str) -> TokenFile | None:
    """The token file already in the cache, or None (absent, or its description is not whole)."""
    if not (out.is_file() and _meta_path(out).is_file()):
        return None
    try:
        made = TokenFile(path=out, **{k: v for k, v in json.loads(_meta_path(out).read_text()).items() if k != "path"})
    except (ValueError, TypeError):
        return None
    whole = made.dtype == dtype and made.tokens * np.dtype(dtype).itemsize == out.stat().st_size
    return made if whole else None


def _write(corpus, tokenizer, val_fraction, out, dtype, show, workers, parallel_from) -> TokenFile:
    with_eot = tokenizer.eot_id is not None
    docs, n_bytes = text_size(corpus, with_eot)
    if workers is None:
        from ..loader import usable_cores
        workers = usable_cores()
    pool = workers if n_bytes >= parallel_from and isinstance(tokenizer, FileTokenizer) and workers > 1 else 0
    what = f"Tokenising {n_bytes / 1e6:.1f} MB of text ({_name(tokenizer)}, " \
           f"{f'{pool} processes' if pool else 'this process'})"
    with atomic_file(out) as f:  # renamed last: the name appears only when the file and its description are whole
        with WorkBar(what, n_bytes, show) as bar:
            counts = _tokenise(pieces(corpus, with_eot, val_fraction), tokenizer, dtype, f, bar, pool)
        made = TokenFile(path=out, dtype=dtype, documents=docs, **counts)
        write_atomically(_meta_path(out), json.dumps({**asdict(made), "path": out.name}).encode())
    return made


def _name(tokenizer: Tokenizer) -> str:
    return f"{tokenizer.name} {tokenizer.vocab_size:,}" if tokenizer.name != "bytes" else "bytes"


def _tokenise(all_pieces: Iterator[Piece], tokenizer: Tokenizer, dtype: str, f, bar: WorkBar, pool: int) -> dict:
    tokens = split_at = val_tokens = val_bytes = 0
    chunks = _chunks(all_pieces)
    encoded = _in_workers(chunks, tokenizer, dtype, pool) if pool else \
        ((val, n, encode_chunk(tokenizer, batch, dtype)) for val, batch, n in chunks)
    for val, n_bytes, ids in encoded:
        f.write(ids.tobytes())
        tokens += len(ids)
        if val:
            val_tokens, val_bytes = val_tokens + len(ids), val_bytes + n_bytes
        else:
            split_at = tokens
        bar.advance(n_bytes)
    return {"tokens": tokens, "split_at": split_at, "val_tokens": val_tokens, "val_bytes": val_bytes}


def _chunks(all_pieces: Iterator[Piece]) -> Iterator[tuple[bool, list[tuple[str, bool]], int]]:
    """(validation?, [(text, ends_document)], bytes): about CHUNK_BYTES each, never both parts in one."""
    batch, size, val = [], 0, False
    for p in all_pieces:
        if batch and (p.val != val or size >= CHUNK_BYTES):
            yield val, batch, size
            batch, size = [], 0
        val = p.val
        batch.append((p.text, p.ends_document))
        size += p.n_bytes
    if batch:
        yield val, batch, size


def encode_chunk(tokenizer: Tokenizer, batch: list[tuple[str, bool]], dtype: str) -> np.ndarray:
    eot, ids = tokenizer.eot_id, []
    for seq, (_, ends) in zip(tokenizer.encode_batch([text for text, _ in batch]), batch):
        ids.extend(seq)
        if ends and eot is not None:
            ids.append(eot)
    return np.asarray(ids, dtype=dtype)


def _in_workers(chunks, tokenizer: FileTokenizer, dtype: str, workers: int):
    """The chunks encoded in `workers` processes, in order, a few in flight per worker."""
    # spawn: a forked child would inherit torch's and tokenizers' thread pools in an unknown state
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                             initargs=(tokenizer.json_text,)) as pool:
        pending = deque()
        for val, batch, n in chunks:
            pending.append((val, n, pool.submit(_encode_in_worker, batch, dtype)))
            if len(pending) >= 2 * workers:
                val0, n0, done = pending.popleft()
                yield val0, n0, done.result()
        while pending:
            val0, n0, done = pending.popleft()
            yield val0, n0, done.result()


_WORKER_TOKENIZER: FileTokenizer | None = None


def _start_worker(json_text: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already: no thread pool in each
    _WORKER_TOKENIZER = FileTokenizer(json_text, "worker")


def _encode_in_worker(batch: list[tuple[str, bool]], dtype: str) -> np.ndarray:
    return encode_chunk(_WORKER_TOKENIZER, batch, dtype)
