"""Shared command-line helper of the benchmark scripts: bad input leaves with one line and exit 2."""

from __future__ import annotations

import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """Print ``error: MESSAGE`` on stderr and leave with exit code 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
