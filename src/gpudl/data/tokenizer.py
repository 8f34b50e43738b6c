"""Text to token ids and back: the one interface training data, generation, evaluation and serving share.

Two kinds: `bytes` (UTF-8 bytes, vocabulary 256: nothing to train or keep, the quick default of
gpt-tiny) and a Hugging Face `tokenizer.json` (a byte-level BPE that gpudl trained on the corpus, or
any other in that format). A run folder keeps its tokenizer as `tokenizer.json` beside `config.toml`;
a run folder without one trained on bytes.

A `tokenizer.json` is somebody else's file: it is JSON, parsed by the `tokenizers` library (Rust), and
nothing in it can run code. One that does not parse is one line naming it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from ..cache import write_atomically
from ..errors import UserError

FILE = "tokenizer.json"
EOT = "<|endoftext|>"   # the special token that ends each document in a token file (GPT-2's)


class Tokenizer:
    """`encode(text) -> ids`, `decode(ids) -> text`; `vocab_size` rows of embedding it needs."""

    name: str
    vocab_size: int
    eot_id: int | None = None   # the id that ends a document in a token file; None: "\n\n" text does

    @property
    def digest(self) -> str:
        """What identifies this tokenizer's ids (the key of token files made with it)."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; bytes that do not (yet) form UTF-8 become U+FFFD."""
        raise NotImplementedError

    def save(self, folder: Path) -> Path | None:
        """Write `folder/tokenizer.json` (None where there is nothing to keep)."""
        return None


class ByteTokenizer(Tokenizer):
    name, vocab_size = "bytes", 256

    @property
    def digest(self) -> str:
        return "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class FileTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer, read from its JSON."""

    def __init__(self, json_text: str, name: str):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise UserError("a BPE tokenizer needs Hugging Face tokenizers: pip install tokenizers") from None
        try:
            self._tok = HFTokenizer.from_str(json_text)
        except Exception as e:  # the library raises its own Exception type for malformed JSON
            raise UserError(f"tokenizer {name!r} is not a tokenizer.json the tokenizers library reads "
                            f"({str(e)[:120]}): use a tokenizer.json saved by tokenizers, or data.tokenizer=bytes") from None
        self.name, self.json_text = name, json_text
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = self._tok.token_to_id(EOT)

    @classmethod
    def from_file(cls, path: Path) -> FileTokenizer:
        try:
            return cls(Path(path).read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read tokenizer {str(path)!r} ({e}): point data.tokenizer at a "
                            f"tokenizer.json") from None

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.json_text.encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, folder: Path) -> Path:
        out = Path(folder) / FILE
        write_atomically(out, self.json_text.encode("utf-8"))
        return out


def run_tokenizer(run_dir: Path) -> Tokenizer:
    """The tokenizer a run folder trained with: its `tokenizer.json`, else bytes."""
    path = Path(run_dir) / FILE
    if path.is_symlink():
        raise UserError(f"{path} is a link: a run folder's files stay inside it; copy the file in instead")
    return FileTokenizer.from_file(path) if path.is_file() else ByteTokenizer()
