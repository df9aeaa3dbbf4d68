"""Stop strings found in text that arrives a piece at a time, at a cost linear in the new text.

One Aho–Corasick automaton over all of a request's stop strings: its state after reading the text
is the longest suffix of the text that begins some stop string, so each arriving character costs
amortised O(1) whatever the stop strings hold. The state answers both questions a stream asks at
every step: did a stop string just end (where, and where does it begin), and how many trailing
characters must be held back because they may still grow into one. Searching with ``str.find``
and re-checking every prefix of every stop string at each token (the scheme before this module)
cost O(len(stop)²) per token, so one request with a long stop string could stall a server's step.

A match is the stop string that *ends first* in the text, the longest of those ending there:
where a stream cuts does not depend on how the text was split into pieces. Automata are built
once per distinct tuple of stop strings and kept (:func:`matcher`): requests repeat theirs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache


class StopMatcher:
    """The automaton of ``stops`` (non-empty strings). States are ints; 0 is the empty suffix."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]  # the length of the suffix a state stands for
        self.ends = [0]  # the longest stop string ending at this state (0: none), through failure links
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ends.append(0)
                state = nxt
            self.ends[state] = max(self.ends[state], len(stop))
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())  # depth 1: failure link 0
        while queue:  # breadth first: a state's failure link is shallower, so already known
            state = queue.popleft()
            for ch, nxt in self.goto[state].items():
                back = self.fail[state]
                while back and ch not in self.goto[back]:
                    back = self.fail[back]
                self.fail[nxt] = self.goto[back].get(ch, 0)  # back is shallower than state: never nxt
                self.ends[nxt] = max(self.ends[nxt], self.ends[self.fail[nxt]])
                queue.append(nxt)

    def step(self, state: int, ch: str) -> int:
        """The state after reading ``ch``."""
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)

    def scan(self, state: int, text: str, offset: int, floor: int = 0) -> tuple[int, int | None]:
        """Read ``text`` (whose first character is at ``offset`` in the whole text) from ``state``.
        Returns the state after it, or — at the first stop string ending past ``floor`` — the state
        there and the start of that stop string in the whole text."""
        ends = self.ends
        for i, ch in enumerate(text):
            state = self.step(state, ch)
            end = offset + i + 1
            if ends[state] and end > floor:
                return state, end - ends[state]
            # a stop string ending at or before floor does not count (vLLM's min_tokens)
        return state, None

    def held(self, state: int) -> int:
        """Trailing characters that may still become (the start of) a stop string."""
        return self.depth[state]


@lru_cache(maxsize=256)
def matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton of ``stops``, built once per distinct tuple."""
    return StopMatcher(stops)
