"""What a new user sees of the command line: ``--help`` shows flags as flags, ``--version`` works."""

from __future__ import annotations

from importlib.metadata import version

import typer
from typer.testing import CliRunner

from moectl.cli import app

runner = CliRunner()


def _verbs(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the click tree: (), ("inspect",), ("subset", "select"), ..."""
    found = [path]
    for name, sub in getattr(command, "commands", {}).items():
        found += _verbs(sub, (*path, name))
    return found


def test_help_of_every_verb_shows_flags_without_a_type():
    """Typer 0.2x printed ``--layerwise <bool>`` (and ``--help <bool>``) though a flag takes no value
    (``--layerwise true`` is refused): no verb's help says ``<bool>``; flags are listed by name."""
    verbs = _verbs(typer.main.get_command(app))
    assert len(verbs) > 30 and ("subset", "select") in verbs
    for verb in verbs:
        result = runner.invoke(app, [*verb, "--help"], env={"COLUMNS": "120"})
        assert result.exit_code == 0, (verb, result.output)
        assert "<bool>" not in result.output, (verb, result.output)
        assert "--help" in result.output
    select = runner.invoke(app, ["subset", "select", "--help"], env={"COLUMNS": "120"}).output
    assert "--layerwise " in select and "<int>" in select  # flags untyped, values still typed
    stream = runner.invoke(app, ["roe", "generate", "--help"], env={"COLUMNS": "120"}).output
    assert "--no-stream" in stream


def test_flags_parse_as_before(tmp_path):
    """Only help changed: a flag still takes no value."""
    args = ["subset", "select", "tiny:olmoe", "--data", "d.jsonl", "--keep", "2", "--out", str(tmp_path / "s.json")]
    result = runner.invoke(app, [*args, "--layerwise", "true"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "unexpected extra argument(s) (true)" in result.output


def test_version_prints_the_installed_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"moectl {version('moectl')}"
