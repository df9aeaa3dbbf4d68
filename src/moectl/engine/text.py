"""A request's text as its tokens arrive: incremental decoding, stop strings, nothing shown twice.

Text is decoded from all generated ids each time (a token may complete a multi-byte character or
merge with the previous one), and only what cannot change any more is shown: a tail that may still
grow into a stop string, or an incomplete UTF-8 character (decoded as U+FFFD), is held back until
the next token or the end. The concatenation of the pieces equals the final text.
"""

from __future__ import annotations

from collections.abc import Sequence


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of ``text`` may still become the start of a stop string."""
    return max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


class TextStream:
    """``push(ids)`` after each step returns (new text, stopped); ``finish()`` the rest at the end."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.shown = ""
        self.text = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        self.ids.extend(int(i) for i in ids)
        full, stopped = cut_at_stop(self._decode(), self.stop)
        if stopped:
            return self._show(full), True
        visible = full[: len(full) - held_back(full, self.stop)].rstrip("\ufffd")
        return self._show(visible), False

    def finish(self) -> str:
        full, _ = cut_at_stop(self._decode(), self.stop)
        return self._show(full)

    def _show(self, visible: str) -> str:
        self.text = visible if visible.startswith(self.shown) else self.shown
        piece = self.text[len(self.shown) :]
        self.shown = self.text
        return piece
