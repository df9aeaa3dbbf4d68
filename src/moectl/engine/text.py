"""A request's text as its tokens arrive: incremental decoding, stop strings, nothing shown twice.

Each step decodes only the tokens since the last complete piece, with the piece before them as
context (a token may complete a multi-byte character, or a tokenizer may drop a word's leading
space at the start of a decode), so a step costs the same at the 10th token as at the 10,000th: the
scheme of vLLM's and transformers' streamers (two offsets into the ids). Only what cannot change
any more is shown: a tail that may still grow into a stop string, or an incomplete UTF-8 character
(decoded as U+FFFD), is held back until the next token or the end. Stop strings are found by one
automaton over all of them (:mod:`moectl.engine.stop_match`) that reads each new character once,
so neither the text's length nor the stop strings' change what a step costs; the text is cut
before the stop string that ends first. Stop strings do not count before ``min_ids`` ids (vLLM's
``min_tokens``: a stop string then counts only where it ends in the text of later ids). ``finish()`` decodes all the ids
once, so the final text is the tokenizer's own decode of them; the concatenation of the pieces
equals it.
"""

from __future__ import annotations

from collections.abc import Sequence

from moectl.engine.stop_match import matcher

MAX_HELD = 32  # ids held back at most while the text ends in an incomplete character (a character is
# at most 4 bytes; ids that split characters unevenly realign within a few ids)


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (it cannot be encoded to UTF-8), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def cut_at_stop(text: str, stop: Sequence[str], start: int = 0) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string found at or after ``start``, and whether one was
    (a whole text at once, as evaluation cuts a generation; a stream uses :class:`StopMatcher`)."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class TextStream:
    """``push(ids)`` after each step returns (new text, stopped); ``finish()`` the rest at the end."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_ids: int = 0) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.longest = max((len(s) for s in self.stop), default=1)  # a stop string's reach back
        self.matcher = matcher(self.stop)
        self.state = 0  # the automaton's state after decoded[:fed]
        self.fed = 0
        self.min_ids = min_ids
        self.floor = 0  # stop strings end past decoded[:floor] (the text before min_ids ids)
        self.ids: list[int] = []
        self.decoded = ""  # the text of ids[: self.read]
        self.prefix = 0  # ids[prefix:read] are decoded again as the context of what follows them
        self.read = 0
        self.shown = ""
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _pending(self) -> str:
        """The text the ids after ``read`` add to ``decoded`` (U+FFFD where a character is incomplete)."""
        head = self._decode(self.ids[self.prefix : self.read])
        tail = self._decode(self.ids[self.prefix :])
        return tail[len(head) :] if tail.startswith(head) else ""

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        self.ids.extend(int(i) for i in ids)
        piece = self._pending()
        # complete characters can no longer change; a tail of U+FFFD is held back until the next ids
        # complete it — but not past MAX_HELD ids: ids that never form a character (a run of
        # continuation bytes, which a logit bias can force) would otherwise be decoded again at every step
        if piece and (not piece.endswith("\ufffd") or len(self.ids) - self.read > MAX_HELD):
            self.decoded += piece
            self.prefix, self.read = self.read, len(self.ids)
        if len(self.ids) < self.min_ids:  # no stop string yet: all the complete text can be shown
            self.floor = len(self.decoded)
            self._feed()
            return self._show(self.decoded), False
        cut = self._feed()
        if cut is not None:
            return self._show(self.decoded[:cut]), True
        return self._show(self.decoded[: len(self.decoded) - self.matcher.held(self.state)]), False

    def _feed(self) -> int | None:
        """Run the automaton over the text decoded since the last call: the cut, if a stop string ended."""
        self.state, cut = self.matcher.scan(self.state, self.decoded[self.fed :], self.fed, self.floor)
        self.fed = len(self.decoded)
        return cut

    def finish(self) -> str:
        full = self._decode(self.ids)
        if not full.startswith(self.decoded):  # a tokenizer whose decode is not additive
            full = self.decoded + self._pending()
        start = max(0, self.floor - self.longest + 1)  # a stop string ending past floor starts here or later
        cut = self.matcher.scan(0, full[start:], start, self.floor)[1]
        return self._show(full if cut is None else full[:cut])

    def _show(self, visible: str) -> str:
        self.text = visible if visible.startswith(self.shown) else self.shown
        piece = self.text[len(self.shown) :]
        self.shown = self.text
        return piece
