"""The progress bar long verbs show: label, bar, done/total, time remaining; gone when done."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def progress_bar(label: str, enabled: bool = True) -> Progress:
    """A transient ``rich`` progress bar (disabled: a no-op with the same interface)."""
    columns = [TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    return Progress(*columns, disable=not enabled, transient=True)
