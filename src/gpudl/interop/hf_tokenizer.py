"""The tokenizer of a Hugging Face GPT-2 folder, both ways: a run's tokenizer as the `tokenizer.json`
and `tokenizer_config.json` that `AutoTokenizer` loads, and a folder's tokenizer (tokenizer.json, or
GPT-2's vocab.json + merges.txt) as a run's. A byte-level run gets a tokenizer.json that encodes text
to its UTF-8 bytes, the ids it trained on, and such a file comes back as bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data.tokenizer import EOT, FILE, ByteTokenizer, FileTokenizer, Tokenizer
from ..errors import UserError


def tokenizer_config(tokenizer: Tokenizer, block_size: int) -> dict:
    """tokenizer_config.json: the fast tokenizer that reads tokenizer.json as it is (no class of its own
    that could rebuild it differently), GPT-2's end-of-text token where the tokenizer has one."""
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
           "clean_up_tokenization_spaces": False}
    if tokenizer.eot_id is not None:
        out.update(bos_token=EOT, eos_token=EOT)
    return out


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """The run's tokenizer.json; for a byte-level run, one that encodes text to its UTF-8 bytes as the run did."""
    if isinstance(tokenizer, FileTokenizer):
        return tokenizer.json_text
    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer_json()
    raise UserError(f"tokenizer {tokenizer.name!r} has no tokenizer.json: --format hf cannot export it")


def byte_tokenizer_json() -> str:
    """A `tokenizers` BPE with no merges whose 256 tokens are the bytes, token id = byte value: GPT-2's
    ByteLevel pre-tokenizer maps each byte to one printable character and the vocabulary maps that back."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models as tok_models, pre_tokenizers

    char = _bytes_to_unicode()
    tok = HFTokenizer(tok_models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table (openai/gpt-2 encoder.py): printable bytes stand for themselves,
    the rest take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def folder_tokenizer(folder: Path) -> Tokenizer | None:
    """The folder's tokenizer: tokenizer.json, else GPT-2's vocab.json + merges.txt (byte-level BPE)
    through `tokenizers`; our own byte-level one comes back as bytes. None where it has neither."""
    if (folder / FILE).is_file():
        tok = FileTokenizer.from_file(folder / FILE)
        return ByteTokenizer() if _same_tokenizer(tok.json_text, byte_tokenizer_json()) else tok
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return FileTokenizer(_vocab_merges_json(folder), str(folder / "vocab.json"))
    return None


def _same_tokenizer(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except json.JSONDecodeError:
        return False


def _vocab_merges_json(folder: Path) -> str:
    """GPT-2's slow tokenizer files as a tokenizer.json: a byte-level BPE, <|endoftext|> special."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models as tok_models, pre_tokenizers

    try:
        tok = HFTokenizer(tok_models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    except Exception as e:  # the library raises its own Exception type for malformed files
        raise UserError(f"model.init_from: {folder}'s vocab.json and merges.txt are not a BPE the tokenizers "
                        f"library reads ({str(e)[:120]}): restore them") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(EOT) is not None:
        tok.add_special_tokens([EOT])
    return tok.to_str()
