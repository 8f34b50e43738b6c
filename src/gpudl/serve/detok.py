"""Token ids to text as they are made, for any tokenizer, with stop texts applied to the text.

One `TextStream` per answer. `feed(token)` returns the text that is now certain; `finish()` the rest
once no token will come. What is held back, and why:

- an unfinished character: a token may hold part of a character's UTF-8 bytes, and the decoded text
  then ends with U+FFFD until the next token completes it. Lossy UTF-8 decoding (Python's, and the
  Rust one a `tokenizer.json`'s byte-level decoder uses) turns an unfinished sequence at the end into
  exactly one U+FFFD, so holding back one trailing U+FFFD is enough; an invalid byte is released a
  token later, as the U+FFFD it is;
- text that may be the start of a stop text: a stop may span several tokens, or begin inside one.

The decoding is incremental and linear in the answer's length: each token decodes a window of the
most recent tokens, not the whole answer (decoding all of it each time is quadratic), and the text
new in the window is what its decode adds past what was already seen (the window keeps a few tokens
of context, so a decoder that treats the first token of a text specially, as SentencePiece's drops
a leading space, does so the same way each time).

>>> from gpudl.data.tokenizer import ByteTokenizer
>>> s = TextStream(ByteTokenizer(), stops=("!",))
>>> [s.feed(b) for b in "é!x".encode()], s.stopped
(['', 'é', '', ''], True)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..data.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
WINDOW = 32    # tokens decoded at most per new token, besides those of an unfinished character
CONTEXT = 8    # tokens the window keeps when it moves on: more than the 4 bytes of any UTF-8 character


class TextStream:
    """The text of one answer, token by token; `stopped` once a stop text appeared (it is not returned)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids: list[int] = []
        self.stopped = False
        self._start = 0   # the window: ids[_start:]
        self._seen = 0    # characters of the window's text already passed on (released or held)
        self._held = ""   # passed on but not released: it may begin a stop text

    def feed(self, token: int) -> str:
        """Take the next token; the text now certain (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids[self._start:])
        settled = len(text) - text.endswith(REPLACEMENT)   # an unfinished character waits for its bytes
        new, self._seen = text[self._seen:settled], max(self._seen, settled)
        if len(self.ids) - self._start > WINDOW:
            self._move_window()
        return self._release(new, final=False)

    def finish(self) -> str:
        """The rest, once no token will come: held text, and an unfinished character as U+FFFD."""
        if self.stopped:
            return ""
        rest = self.tokenizer.decode(self.ids[self._start:])[self._seen:]
        self._seen += len(rest)
        return self._release(rest, final=True)

    def _move_window(self) -> None:
        self._start = len(self.ids) - CONTEXT
        text = self.tokenizer.decode(self.ids[self._start:])
        # The window's text ends where the old one's did: all of it is passed on but an unfinished character.
        self._seen = len(text) - text.endswith(REPLACEMENT)

    def _release(self, new: str, final: bool) -> str:
        text = self._held + new
        at = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if at >= 0:
            self.stopped, self._held = True, ""
            return text[:at]
        keep = 0 if final else _stop_start(text, self.stops)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]


def _stop_start(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins a stop text (0: none does)."""
    longest = 0
    for stop in stops:
        # Candidates start where the stop's first character occurs in the last len(stop) - 1 characters.
        i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while i >= 0 and len(text) - i > longest:
            if stop.startswith(text[i:]):
                longest = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return longest


@functools.lru_cache(maxsize=8)  # per tokenizer object: a server asks it for every request
def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """An upper bound of the UTF-8 bytes one token stands for (each token decoded alone; a part of a
    character decodes to U+FFFD, 3 bytes, as many as the part can hold; +1: a decoder may drop a
    token's leading space)."""
    return max((len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size)), default=0) + 1
