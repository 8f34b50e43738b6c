"""A byte-level BPE trained on the corpus (`data.tokenizer=bpe`), as GPT-2's is made: offline, on
the training part only, sized to the model's vocabulary, and kept in the cache.

Byte-level: the text is split as GPT-2 splits it (the ByteLevel pre-tokenizer) and every one of
the 256 bytes is in the alphabet, so any text encodes and decodes back to itself; `<|endoftext|>`
(id 0) ends each document. Trained with Hugging Face `tokenizers` (a dependency of gpudl),
which gives the same merges for the same text. The cached file's name is a digest of the corpus
(`Corpus.fingerprint`), the vocabulary size, the split and this format.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ...cache import cache_dir, write_atomically
from ...errors import UserError
from .cache import WorkBar, cache_key, cache_lock
from .sources import Corpus
from .token_file import split_byte, text_size, training_texts
from ..tokenizer import EOT, FileTokenizer

BPE_FORMAT = 1   # bump when the training below changes, so cached tokenizers are retrained
SMALLEST = 256 + 2   # the bytes, the end-of-text token and one merge


def bpe_tokenizer(corpus: Corpus, vocab_size: int, val_fraction: float, show: bool = True) -> FileTokenizer:
    """The BPE of `corpus`'s training part with `vocab_size` tokens (fewer where the text has fewer
    pairs to merge): trained the first time, read from the cache after."""
    if vocab_size < SMALLEST:
        raise UserError(f"data.tokenizer=bpe needs model.vocab_size >= {SMALLEST} (the 256 bytes, {EOT} and merges), "
                        f"got {vocab_size}: set --set model.vocab_size=50304, or data.tokenizer=bytes")
    path = cache_dir() / f"bpe-{corpus.label}-{vocab_size}-{cache_key(BPE_FORMAT, corpus.fingerprint, vocab_size, val_fraction)}.json"
    with cache_lock(path):
        if not path.is_file():
            train_bytes = split_byte(text_size(corpus, True)[1], val_fraction)
            with WorkBar(f"Training a {vocab_size:,}-token BPE on {train_bytes / 1e6:.1f} MB of text", train_bytes,
                         show) as bar:
                json_text = train_bpe(training_texts(corpus, val_fraction), vocab_size, bar)
            write_atomically(path, json_text.encode("utf-8"))
    return FileTokenizer(path.read_text(encoding="utf-8"), "bpe")


def train_bpe(texts: Iterable[str], vocab_size: int, bar: WorkBar | None = None) -> str:
    """The tokenizer.json of a byte-level BPE with `vocab_size` tokens trained on `texts`."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UserError("data.tokenizer=bpe needs Hugging Face tokenizers: pip install tokenizers, or "
                        "set data.tokenizer=bytes") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_counted(texts, bar, vocab_size), trainer)
    return tok.to_str()


def _counted(texts: Iterable[str], bar: WorkBar | None, vocab_size: int) -> Iterator[str]:
    """`texts`, advancing the bar by their bytes; once read, the trainer merges (a stage of its own)."""
    for text in texts:
        yield text
        if bar is not None:
            bar.advance(len(text.encode("utf-8")))
    if bar is not None:
        bar.stage(f"Merging pairs into {vocab_size:,} tokens")
