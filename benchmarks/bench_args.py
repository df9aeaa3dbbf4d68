"""Shared pieces of the benchmark scripts: bad input leaves with one line and exit 2; the prompts the
serving benchmarks send."""

from __future__ import annotations

import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """Print ``error: MESSAGE`` on stderr and leave with exit code 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def int_list(text: str, flag: str) -> list[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]``; anything else leaves with ``error: FLAG must be ...``."""
    try:
        return [int(b) for b in text.split(",")]
    except ValueError:
        fail(f"{flag} must be a comma list of integers, got {text!r}")


PROMPTS = [
    "The mixture of experts routes each token to",
    "In a quiet village by the sea, the old lighthouse keeper",
    "def fibonacci(n):\n    ",
    "The theorem follows from the observation that",
    "Once upon a time",
    "The capital of France is",
    "To train a language model, one first",
    "Experts in the last layer specialise in",
]
