"""Token ids to streamed text (serve/detok.py) with the byte tokenizer and a real byte-level BPE: the
pieces join to what the tokenizers library decodes, no piece holds a U+FFFD for a character that
was only unfinished, a stop text ends the text where it begins (across tokens, or inside one), and
the decoding cost per token stays bounded however long the answer."""

from __future__ import annotations

import random

import pytest

from bpe_run import SENTENCE, hf_tokenizer, split_characters
from gpudl.data.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer
from gpudl.serve.detok import WINDOW, TextStream, longest_token_bytes

pytest.importorskip("tokenizers")
ANSWER = "Grüße, 世界 🙂!"   # 1-, 2-, 3- and 4-byte UTF-8 characters


@pytest.fixture(scope="module")
def bpe():
    """(gpudl's FileTokenizer, the tokenizers library's own object: the reference) of one tokenizer.json."""
    hf = hf_tokenizer()
    return FileTokenizer(hf.to_str(), "test-bpe"), hf


def pieces(stream: TextStream, ids: list[int], reference: str) -> list[str]:
    """Feed ids one by one; after each, what was released must begin the reference (a U+FFFD given
    out for a character still unfinished could not be taken back, and would not)."""
    out = []
    for token in ids:
        out.append(stream.feed(token))
        assert reference.startswith("".join(out)), (out, reference)
        if stream.stopped:
            break
    out.append(stream.finish())
    return out


def test_bytes_split_anywhere_stream_whole_characters():
    raw = ANSWER.encode()
    for cut in range(len(raw) + 1):   # every split point, inside each multi-byte character too
        s = TextStream(ByteTokenizer())
        got = [s.feed(b) for b in raw[:cut]] + [s.feed(b) for b in raw[cut:]] + [s.finish()]
        assert "".join(got) == ANSWER and "\ufffd" not in "".join(got)
    s = TextStream(ByteTokenizer())
    assert [s.feed(b) for b in "🙂".encode()] == ["", "", "", "🙂"]
    s = TextStream(ByteTokenizer())
    assert "".join([s.feed(b) for b in b"a\xffb"]) == "a\ufffdb"   # an invalid byte: a U+FFFD, given out
    s = TextStream(ByteTokenizer())
    assert s.feed("é".encode()[0]) == "" and s.finish() == "\ufffd"  # cut off at the end of the answer


def test_bpe_characters_split_across_tokens_stream_whole(bpe):
    tok, hf = bpe
    ids = hf.encode(SENTENCE * 3).ids
    assert set(split_characters(hf, ids)) >= {"ü", "世", "🙂", "é"}   # the case this test is about
    got = pieces(TextStream(tok), ids, hf.decode(ids))
    assert "".join(got) == SENTENCE * 3 and not any("\ufffd" in p for p in got)


@pytest.mark.parametrize("stop", ["café →", "ne.\n", "🙂", "世"])
def test_a_stop_across_tokens_or_inside_one_ends_the_text_where_it_begins(bpe, stop):
    tok, hf = bpe
    text = "intro " + SENTENCE * 2
    ids = hf.encode(text).ids
    spans = [i for i in range(len(ids)) if stop in hf.decode(ids[:i + 1]) and stop not in hf.decode(ids[:i])]
    made = spans[0] + 1   # tokens until the stop text is complete: the stream must stop there
    s = TextStream(tok, stops=("never in it", stop))
    got = pieces(s, ids, text)
    assert s.stopped and len(s.ids) == made and "".join(got) == text[:text.index(stop)]
    assert stop not in "".join(got)


def first_stop(hf, ids: list[int], stops: list[str]) -> int:
    """Where the answer ends, as a server that checks its text after each token ends it: at the first token
    whose text holds a stop, cut where the earliest stop in it begins (a longer stop that began earlier but
    would end later never completes: generation has stopped)."""
    for k in range(1, len(ids) + 1):
        text = hf.decode(ids[:k])
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return min(found)
    return len(hf.decode(ids))


def test_random_tokens_and_stops_against_the_library(bpe):
    """Any token sequence, invalid UTF-8 too: the pieces are the library's decode, cut at the first stop
    that appears as the tokens come (stops may overlap: 'g{g' and '{' in '...g{g...' end at the '{')."""
    tok, hf = bpe
    rng = random.Random(7)
    for case in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        full = hf.decode(ids)
        stops = [full[i:i + rng.randrange(1, 6)] for i in (rng.randrange(len(full) + 1) for _ in range(2))]
        stops = [s for s in stops if s and "\ufffd" not in s] if case % 3 else []
        got = pieces(TextStream(tok, stops), ids, full)
        assert "".join(got) == full[:first_stop(hf, ids, stops)], (ids, stops)


def test_of_overlapping_stops_the_one_that_appears_first_ends_the_answer():
    """'g{g!' begins before '{' but is not complete when '{' is: the answer ends before the '{'."""
    s = TextStream(ByteTokenizer(), stops=("g{g!", "{"))
    assert "".join(s.feed(b) for b in b"pying{g!out") + s.finish() == "pying" and s.stopped


class Counting(Tokenizer):
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, inner: Tokenizer):
        self.inner, self.name, self.vocab_size, self.sizes = inner, inner.name, inner.vocab_size, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.inner.decode(ids)


@pytest.mark.parametrize("unit", ["é", "\x80"])   # whole characters; invalid bytes (each ends in U+FFFD)
def test_decoding_stays_bounded_for_long_answers(unit):
    raw = (unit * 5000).encode("utf-8") if unit != "\x80" else b"\x80" * 5000
    counting = Counting(ByteTokenizer())
    s = TextStream(counting)
    text = "".join(s.feed(b) for b in raw) + s.finish()
    assert text == raw.decode("utf-8", errors="replace")
    assert len(counting.sizes) <= 2 * len(raw) + 1 and max(counting.sizes) <= WINDOW + 1


def test_longest_token_bytes_bounds_what_any_token_stands_for(bpe):
    tok, hf = bpe
    longest = max(len(hf.decode([i]).encode()) for i in range(hf.get_vocab_size()))
    assert longest_token_bytes(tok) == longest + 1 and longest > 3   # BPE merged tokens longer than a character
    assert longest_token_bytes(ByteTokenizer()) == 4                # a byte alone decodes to at most U+FFFD's 3
