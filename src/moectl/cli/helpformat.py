"""``--help`` shows a flag as a flag: ``--layerwise``, ``--stream / --no-stream``, never ``<bool>``.

Typer 0.2x's rich help prints a type column for every option, flags included (``--layerwise <bool>``,
even ``--help <bool>``), which reads as if the flag took a value, while ``--layerwise true`` is
refused. :func:`flags_untyped` gives every command and group of an app help that leaves the type
column of a flag empty; parsing is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from typer.core import TyperCommand

from moectl.cli.common import MoectlGroup
from moectl.cli.extras import extras_named


@contextmanager
def _no_flag_types(params: Sequence[Any]) -> Iterator[None]:
    """While help is written: a flag's metavar is empty, so its type column is blank (typer prints
    the metavar where one is set instead of the type); afterwards as it was. (Typer 0.2x carries its
    own copy of click, so options are recognised by their ``is_flag``, not by click's classes.)"""
    flags = [p for p in params if getattr(p, "is_flag", False) and getattr(p, "metavar", "") is None]
    for flag in flags:
        flag.metavar = ""
    try:
        yield
    finally:
        for flag in flags:
            flag.metavar = None


class FlagCommand(TyperCommand):
    """A verb whose ``--help`` shows flags without a type, and which names the extra it needs when
    that is not installed (:func:`moectl.cli.extras.extras_named`)."""

    def invoke(self, ctx: Any) -> Any:
        with extras_named(ctx):
            return super().invoke(ctx)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _no_flag_types(self.get_params(ctx)):
            super().format_help(ctx, formatter)


class FlagGroup(MoectlGroup):
    """A verb group whose ``--help`` shows flags without a type (and, as every group of moectl, the
    CLI's one error handler: :class:`~moectl.cli.common.MoectlGroup`)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _no_flag_types(self.get_params(ctx)):
            super().format_help(ctx, formatter)


def flags_untyped(app: typer.Typer) -> None:
    """Build every command of ``app`` (and of its sub-apps, recursively) as :class:`FlagCommand` and
    every group as :class:`FlagGroup`, unless a command names a class of its own (``app.command()``
    records typer's own ``TyperCommand`` where none is named). Call once, after every command is
    registered."""
    for command in app.registered_commands:
        if command.cls in (None, TyperCommand):
            command.cls = FlagCommand
    for group in app.registered_groups:
        group.cls = FlagGroup
        if group.typer_instance is not None:
            flags_untyped(group.typer_instance)
