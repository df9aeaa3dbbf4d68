"""TextStream: pieces concatenate to the tokenizer's decode, stop strings cut, and a step's cost does
not grow with the text (each push decodes the tokens since the last piece, not all of them)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from moectl.engine.text import TextStream

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def byte_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "models" / "moectl-small-standard")


class Counting:
    """A tokenizer that counts the ids it was asked to decode."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class Words:
    """A SentencePiece-like tokenizer: id i is "▁word" or a suffix, and a decode drops the leading
    space of its first word (as Llama's does), so a token alone decodes without it."""

    def __init__(self, pieces: tuple[str, ...] = ("▁the", "▁cat", "s", "▁sat", "▁on", "▁mat", ".", "▁a")):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


def _stream(tok, ids, stop=(), per_push=1):
    stream, pieces, stopped = TextStream(tok, stop), [], False
    for i in range(0, len(ids), per_push):
        piece, stopped = stream.push(ids[i : i + per_push])
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(stream.finish())
    return stream, pieces, stopped


@pytest.mark.parametrize("per_push", [1, 3])
def test_pieces_concatenate_to_the_decode_of_multibyte_text(byte_tok, per_push):
    ids = byte_tok.encode("héllo wörld ☃ 日本語 — ok", add_special_tokens=False)
    stream, pieces, _ = _stream(byte_tok, ids, per_push=per_push)
    assert "".join(pieces) == byte_tok.decode(ids) == stream.text
    assert not any("\ufffd" in p for p in pieces)  # an incomplete character is held, never shown
    assert sum(1 for p in pieces if p) > 3  # shown as it arrives, not all at the end


def test_random_bytes_including_invalid_utf8_concatenate_to_the_decode(byte_tok):
    rng = random.Random(0)
    ids = [rng.randrange(byte_tok.vocab_size) for _ in range(400)]
    _, pieces, _ = _stream(byte_tok, ids)
    assert "".join(pieces) == byte_tok.decode(ids, skip_special_tokens=True)


def test_a_decode_that_drops_the_leading_space_keeps_it_between_pieces():
    tok = Words()
    ids = [0, 1, 2, 3, 4, 0, 5, 6]
    _, pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == "the cats sat on the mat."
    assert pieces[1] == " cat"


def test_a_stop_string_across_pushes_cuts_the_text_and_is_never_shown(byte_tok):
    text = "alpha beta STOP gamma"
    ids = byte_tok.encode(text, add_special_tokens=False)
    stream, pieces, stopped = _stream(byte_tok, ids, stop=["STOP", "zz"])
    assert stopped and "".join(pieces) == "alpha beta " == stream.text
    assert all("S" not in p for p in pieces)


def test_a_stop_string_is_found_when_it_ends_many_pushes_after_it_began(byte_tok):
    stop = "<end of a long stop>"
    ids = byte_tok.encode("x" * 50 + stop + "y", add_special_tokens=False)
    _, pieces, stopped = _stream(byte_tok, ids, stop=[stop])
    assert stopped and "".join(pieces) == "x" * 50


def test_the_text_that_may_begin_a_stop_string_is_held_then_shown(byte_tok):
    ids = byte_tok.encode("ab", add_special_tokens=False)
    stream = TextStream(byte_tok, ["bc"])
    shown = [stream.push([i])[0] for i in ids]
    assert shown[-1] == "" or not shown[-1].endswith("b")  # "b" may become "bc": held
    assert "".join(shown) + stream.finish() == "ab"


def test_each_push_decodes_a_bounded_number_of_ids(byte_tok):
    """2,000 tokens: all pushes together decode a few ids per token (a full re-decode per token
    would be 2,000,000)."""
    counting = Counting(byte_tok)
    ids = byte_tok.encode("the quick brown fox jumps. " * 200, add_special_tokens=False)[:2000]
    stream = TextStream(counting, ["never there"])
    for i in ids:
        stream.push([i])
    during = counting.decoded
    assert during < 6 * len(ids)
    shown_before = stream.shown
    assert shown_before + stream.finish() == stream.text == byte_tok.decode(ids)


def test_ids_that_never_form_a_character_are_not_decoded_again_at_every_step(byte_tok):
    """2,000 lone continuation bytes (which a logit bias can force) decode to U+FFFD for ever: the held
    tail is shown past ``MAX_HELD`` ids, so each push still decodes a few ids, not all of them."""
    lone = next(i for i in range(byte_tok.vocab_size) if byte_tok.decode([i] * 6) == "\ufffd" * 6)
    counting = Counting(byte_tok)
    stream = TextStream(counting)
    shown = "".join(stream.push([lone])[0] for _ in range(2000))
    assert counting.decoded < 100 * 2000  # re-decoding the whole held tail at every push: ≈ 2,000,000
    assert len(shown) > 1900 and set(shown) == {"\ufffd"}
    assert shown + stream.finish() == stream.text


def test_a_decode_that_is_not_additive_still_ends_with_everything_shown():
    """A tokenizer whose decode of all ids is not the pieces joined (here it capitalises a long
    text's first letter): nothing shown is taken back, nothing is lost."""

    class Tidy(Words):
        def decode(self, ids, skip_special_tokens=True) -> str:
            out = super().decode(ids).replace(" .", ".")
            return out[:1].upper() + out[1:] if len(ids) > 3 else out

    tok = Tidy(("▁the", "▁cat", "▁.", "▁a"))
    stream, shown, _ = _stream(tok, [0, 1, 2, 3])
    assert "".join(shown) == stream.text == "the cat. a"


class Bytes:
    """Token id = one byte."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_stop_strings_count_only_from_min_ids_on():
    """vLLM's min_tokens: a stop string whose text ends within the first ``min_ids`` - 1 ids does not
    stop (the text shows whole, nothing held back); one that ends at a later id does, also when it
    began earlier (then what was already shown stays)."""
    ids = list(b"abcabc")
    early = TextStream(Bytes(), ["bc"], min_ids=4)
    pieces = [early.push([i]) for i in ids]
    assert [stopped for _, stopped in pieces] == [False] * 5 + [True]
    assert "".join(p for p, _ in pieces) == "abca"  # the first "bc" shown, the text cut before the second
    across = TextStream(Bytes(), ["ca"], min_ids=4)
    got = [across.push([i]) for i in ids[:4]]
    assert [stopped for _, stopped in got] == [False, False, False, True]
    assert "".join(p for p, _ in got) == "abc"
    never = TextStream(Bytes(), ["bc"], min_ids=7)
    assert not any(never.push([i])[1] for i in ids)
    never.finish()
    assert never.text == "abcabc"
