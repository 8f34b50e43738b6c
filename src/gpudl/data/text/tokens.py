"""Text for a language model: which tokenizer (`data.tokenizer`, or the one a run folder kept), which
token file, how many bytes of text a token stands for, and the start block's line about it all.

`data.tokenizer`: bytes (UTF-8 bytes, vocabulary 256); bpe (a byte-level BPE trained on the training
part, sized to model.vocab_size, `bpe.py`); a path to a tokenizer.json; auto: bpe where the model
knows more ids than 256 (the GPT-2 recipes' 50,304), else bytes (gpt-tiny, the quick first run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...config import DataConfig
from ...errors import UserError
from .bpe import bpe_tokenizer
from .streams import TokenStream, byte_file
from .sources import Corpus, find_corpus
from .token_file import token_file
from ..tokenizer import ByteTokenizer, FileTokenizer, Tokenizer

NAMED = ("auto", "bytes", "bpe")


@dataclass
class TextTokens:
    stream: TokenStream
    tokenizer: Tokenizer
    bytes_per_token: float | None   # UTF-8 bytes of the validation text per validation token
    description: str


def text_tokens(cfg: DataConfig, vocab_size: int, kept: Tokenizer | None = None, show: bool = True) -> TextTokens:
    """data.path's text as tokens for a model of `vocab_size` ids, through `kept` where a run folder
    has its tokenizer (a resumed or evaluated run: never trained again), else through data.tokenizer."""
    corpus = find_corpus(cfg.path, cfg.text_field)
    tokenizer = kept or choose_tokenizer(cfg.tokenizer, corpus, vocab_size, cfg.val_fraction, show)
    if tokenizer.vocab_size > vocab_size:
        fit = -(-tokenizer.vocab_size // 64) * 64  # a multiple of 64, as GPT-2's 50,257 became 50,304: faster matmuls
        raise UserError(f"the tokenizer {_shown(tokenizer)} has {tokenizer.vocab_size:,} tokens but model.vocab_size="
                        f"{vocab_size}: set --set model.vocab_size={fit}")
    what = "Python standard-library source" if cfg.path is None else cfg.path
    if isinstance(tokenizer, ByteTokenizer) and corpus.plain_text:  # files as bytes, as they have always been read
        stream = TokenStream(byte_file(corpus), "uint8", cfg.val_fraction)
        return TextTokens(stream, tokenizer, 1.0, f"{what}: {corpus.what}, {_count(len(stream.tokens))} tokens "
                                                  f"(bytes){corpus.skipped_note()}")
    made = token_file(corpus, tokenizer, cfg.val_fraction, show)
    stream = TokenStream(made.path, made.dtype, split_at=made.split_at)
    per = made.bytes_per_token
    shown = "bytes" if isinstance(tokenizer, ByteTokenizer) else \
        f"{_shown(tokenizer)} {tokenizer.vocab_size:,}" + (f", {per:.1f} bytes/token" if per else "")
    return TextTokens(stream, tokenizer, per, f"{what}: {corpus.what}, {made.documents:,} documents, "
                                              f"{_count(made.tokens)} tokens ({shown}){corpus.skipped_note()}")


def choose_tokenizer(setting: str, corpus: Corpus, vocab_size: int, val_fraction: float, show: bool) -> Tokenizer:
    if setting == "auto":
        setting = "bpe" if vocab_size > ByteTokenizer.vocab_size else "bytes"
    if setting == "bytes":
        return ByteTokenizer()
    if setting == "bpe":
        return bpe_tokenizer(corpus, vocab_size, val_fraction, show)
    path = Path(setting).expanduser()
    if not path.is_file():
        raise UserError(f"data.tokenizer={setting!r} is none of {', '.join(NAMED)} and not a tokenizer.json file: "
                        f"set one of those, or the path of a tokenizer.json")
    return FileTokenizer.from_file(path)


def _shown(tokenizer: Tokenizer) -> str:
    return tokenizer.name if tokenizer.name in NAMED else Path(tokenizer.name).name


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n:,}"
