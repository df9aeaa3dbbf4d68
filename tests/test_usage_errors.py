"""A bad option value, a missing argument or an unknown verb is one ``error:`` line with exit code 2,
as every other refusal is, not typer's usage box (issue #43 item 2)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moectl.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["offload", "simulate", "TRACE", "--num-experts", "E"],
         "error: Invalid value for '--num-experts': Input should be a valid integer, unable to parse string as an integer"),
        (["inspect", "--tiny", "olmoe", "--bogus"], "error: No such option: --bogus"),
        (["subset", "select"], "error: Missing argument 'model'."),
        (["nosuchverb"], "error: No such command 'nosuchverb'."),
        (["--bogus"], "error: No such option: --bogus"),
        (["inspect"], "error: give exactly one of MODEL (tiny:FAMILY, a checkpoint path or hub id) or --tiny FAMILY"),
    ],
)  # fmt: skip
def test_a_usage_error_is_one_line_and_exit_2(args, line):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == line
    assert result.stdout == ""


def test_a_group_given_no_verb_still_shows_its_help():
    result = runner.invoke(app, ["subset"])
    assert "select" in result.output and "export" in result.output
    assert "error:" not in result.output
