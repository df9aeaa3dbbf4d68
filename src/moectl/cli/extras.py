"""A verb whose extra is not installed says so in one line, before any work, and exits 2.

``error: moectl serve needs the serve extra: pip install 'moectl[serve]'``. Every verb runs inside
:func:`extras_named` (``FlagCommand.invoke`` in ``helpformat.py``): a verb of :data:`VERBS`, or one
given ``--plot``, is checked when its command line has been parsed (``--help`` and bad options
answer first), and an optional module found missing later ends the verb with the same line.
Which module belongs to which extra is :data:`moectl.extras.MODULES`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from moectl.extras import message, missing_extra, missing_modules

VERBS: dict[str, str] = {  # verb path -> the extra it always needs
    "serve": "serve",
    "eval": "eval",
    "data fetch-evals": "eval",
    "modularity": "plots",
    "pretrain": "train",
    "options train": "train",
    "subset finetune": "train",
    "roe tune": "train",
}


def verb_of(ctx: click.Context) -> str:
    """The verb a context runs, as typed after ``moectl`` (``"subset finetune"``), whatever the
    program's name (``moectl``, ``python -m moectl``, a test runner's)."""
    names: list[str] = []
    while ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(reversed(names))


PARAMS: dict[str, str] = {"plot": "plots", "plot_dir": "plots"}  # a verb's parameter -> the extra it needs when given


def check_verb(verb: str, params: dict[str, Any]) -> None:
    """``error: moectl VERB needs the EXTRA extra: ...`` and exit 2 when ``verb`` is one of
    :data:`VERBS`, or is given a parameter of :data:`PARAMS` (``--plot``), and that extra is not
    installed."""
    needed = [VERBS.get(verb)] + [extra for name, extra in PARAMS.items() if params.get(name)]
    for extra in needed:
        if extra is not None and missing_modules(extra):
            fail_extra(verb, extra)


def fail_extra(verb: str, extra: str) -> None:
    """The one line and exit code 2 (``moectl.cli.common.fail``)."""
    from moectl.cli.common import fail

    fail(message(f"moectl {verb}".rstrip(), extra))


@contextmanager
def extras_named(ctx: click.Context) -> Iterator[None]:
    """Run a verb: its extra checked first (:func:`check_verb`), and an optional module found
    missing inside it (``ImportError`` of a module of :data:`moectl.extras.MODULES` that is not
    installed, or a :class:`~moectl.errors.MissingExtraError`) as the same one line."""
    verb = verb_of(ctx)
    check_verb(verb, ctx.params)
    try:
        yield
    except ImportError as err:
        extra = missing_extra(err)
        if extra is None:
            raise
        fail_extra(verb, extra)
