"""The progress bar long verbs show: label, bar, done/total, time remaining; gone when done.

Shown only where someone watches: on an interactive terminal (rich's console on standard output:
``Console.is_interactive``) or in a notebook. Output piped or redirected (``moectl eval ... > out.txt``, a verb's
``--json`` consumer, a CI log) gets no bar and not even the blank line ``rich`` leaves behind a
finished bar on a non-terminal. Every bar is transient: the terminal keeps the results only.
"""

from __future__ import annotations

from rich import get_console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_shown(enabled: bool = True) -> bool:
    """Whether a bar asked for (``enabled``) is drawn: on an interactive terminal (or a notebook)."""
    console = get_console()
    return enabled and (console.is_interactive or console.is_jupyter)


def progress_bar(
    label: str, enabled: bool = True, *, elapsed: bool = False, suffix: str | None = None
) -> Progress:
    """A transient ``rich`` progress bar (disabled, or not on an interactive terminal: a no-op with
    the same interface).

    ``label`` and ``suffix`` are ``rich`` text-column formats (``{task.description}``,
    ``{task.fields[name]}`` are filled per task). ``elapsed`` shows the time spent instead of the
    time remaining (for steps whose length the count does not predict); ``suffix`` is a text
    column after the time.
    """
    time: ProgressColumn = TimeElapsedColumn() if elapsed else TimeRemainingColumn()
    columns: list[ProgressColumn] = [TextColumn(label), BarColumn(), MofNCompleteColumn(), time]
    if suffix is not None:
        columns.append(TextColumn(suffix))
    return Progress(*columns, console=get_console(), disable=not progress_shown(enabled), transient=True)
