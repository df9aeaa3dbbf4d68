"""Sphinx directive ``moectl-cli``: the command-line reference, generated from the typer commands.

sphinx-click cannot read typer >= 0.2x's commands (typer vendors a trimmed click whose classes are
not ``click.Command``), so this walks ``typer.main.get_command(moectl.cli.app)`` itself: one section
per verb with its usage line, help text and every option's ``--help`` line (default included).
"""

from __future__ import annotations

import re
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

_SPECIAL = re.compile(r"([\\`*|_\[\]<>])")
_UNDERLINE = "=-~^\"'"


def _escape(text: str) -> str:
    """Help text as literal reST text (no role, emphasis or reference markup)."""
    return _SPECIAL.sub(r"\\\1", text)


def _command_rst(command: Any, path: list[str], level: int) -> list[str]:
    import typer._click as click

    name = " ".join(path)
    ctx = click.Context(command, info_name=name)
    lines = [name, _UNDERLINE[level] * (len(name) + 4), ""]
    help_text = (command.help or "").strip()
    if help_text:
        for para in help_text.split("\n\n"):
            lines += [_escape(" ".join(para.split())), ""]
    pieces = " ".join(command.collect_usage_pieces(ctx))
    lines += [".. code-block:: text", "", f"   Usage: {name} {pieces}".rstrip(), ""]
    records = [p.get_help_record(ctx) for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    records = [r for r in records if r is not None]
    if records:
        lines += [".. list-table::", "   :widths: 30 70", ""]
        for opts, text in records:
            lines += [f"   * - ``{opts}``", f"     - {_escape(' '.join(text.split())) or '—'}"]
        lines.append("")
    subcommands = getattr(command, "commands", {})
    for sub_name, sub in subcommands.items():
        if not getattr(sub, "hidden", False):
            lines += _command_rst(sub, [*path, sub_name], level + 1)
    return lines


class MoectlCli(SphinxDirective):
    """Insert the reference of every ``moectl`` verb (sections, nested by verb group)."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        import typer

        from moectl.cli import app

        command = typer.main.get_command(app)
        lines: list[str] = []
        for sub_name, sub in command.commands.items():
            lines += _command_rst(sub, ["moectl", sub_name], 0)
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source="moectl --help"), node)
        return node.children


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("moectl-cli", MoectlCli)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
