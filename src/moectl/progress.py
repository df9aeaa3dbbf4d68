"""The progress bar long verbs show: label, bar, done/total, time remaining; gone when done."""

from __future__ import annotations

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_bar(
    label: str, enabled: bool = True, *, elapsed: bool = False, suffix: str | None = None
) -> Progress:
    """A transient ``rich`` progress bar (disabled: a no-op with the same interface).

    ``label`` and ``suffix`` are ``rich`` text-column formats (``{task.description}``,
    ``{task.fields[name]}`` are filled per task). ``elapsed`` shows the time spent instead of the
    time remaining (for steps whose length the count does not predict); ``suffix`` is a text
    column after the time.
    """
    time: ProgressColumn = TimeElapsedColumn() if elapsed else TimeRemainingColumn()
    columns: list[ProgressColumn] = [TextColumn(label), BarColumn(), MofNCompleteColumn(), time]
    if suffix is not None:
        columns.append(TextColumn(suffix))
    return Progress(*columns, disable=not enabled, transient=True)
