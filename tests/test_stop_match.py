"""The stop-string automaton equals a brute-force search, and a stream's cost does not grow with its
stop strings (one request with a 5,000,000-character stop string once froze ``moectl serve``)."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from moectl.engine.stop_match import StopMatcher
from moectl.engine.text import TextStream

alphabet = st.sampled_from("abc")
stops_st = st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=4)


def first_stop(text: str, stops: list[str], floor: int) -> int | None:
    """Brute force: the start of the longest stop string among those that end first past ``floor``."""
    for end in range(floor + 1, len(text) + 1):
        hits = [end - len(s) for s in stops if end - len(s) >= 0 and text[end - len(s) : end] == s]
        if hits:
            return min(hits)
    return None


def may_begin(text: str, stops: list[str]) -> int:
    """Brute force: the longest suffix of ``text`` that begins some stop string."""
    return max((n for s in stops for n in range(1, len(s) + 1) if text.endswith(s[:n])), default=0)


@settings(max_examples=300, deadline=None)
@given(stops=stops_st, text=st.text(alphabet, max_size=30), floor=st.integers(0, 10), split=st.integers(0, 30))
def test_the_automaton_finds_what_brute_force_finds_however_the_text_is_split(stops, text, floor, split):
    m = StopMatcher(stops)
    floor = min(floor, len(text))
    expected = first_stop(text, stops, floor)
    state, cut = m.scan(0, text[:split], 0, floor)
    if cut is None:
        state, cut = m.scan(state, text[split:], min(split, len(text)), floor)
    assert cut == expected
    if expected is None:
        assert m.held(state) == may_begin(text, stops)


def test_a_stream_cuts_before_the_stop_string_that_ends_first():
    class Chars:
        def decode(self, ids, skip_special_tokens=True) -> str:
            return "".join(map(chr, ids))

    whole = TextStream(Chars(), ["abcd", "bc"])
    assert whole.push([ord(c) for c in "xabcd"]) == ("xa", True)  # "bc" ends first, in one push or in five
    apart = TextStream(Chars(), ["abcd", "bc"])
    pieces = [apart.push([ord(c)]) for c in "xabc"]
    assert "".join(p for p, _ in pieces) == "xa" and pieces[-1][1]


def test_a_push_costs_the_same_with_a_huge_stop_string():
    """A 200,000-character stop string: 200 pushes of text that keeps matching its start take a
    bounded multiple of the same pushes with no stop string (before: every prefix of the stop string
    sliced at every push, hours for this)."""

    class Chars:
        def decode(self, ids, skip_special_tokens=True) -> str:
            return "".join(map(chr, ids))

    def pushes(stop: list[str]) -> float:
        stream = TextStream(Chars(), stop)
        t0 = time.perf_counter()
        for _ in range(200):
            stream.push([ord("z")])
        return time.perf_counter() - t0

    huge = ["z" * 200_000]
    TextStream(Chars(), huge)  # the automaton is built once per distinct stop list (kept): not timed
    plain = min(pushes([]) for _ in range(3))
    long = min(pushes(huge) for _ in range(3))
    assert long < 20 * plain + 0.05, (long, plain)
