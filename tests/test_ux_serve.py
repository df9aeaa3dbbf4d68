"""``moectl serve-offload``'s table as a user reads it: the switch rate, or why there is none, and
where the load timeline went."""

from __future__ import annotations

from typer.testing import CliRunner

from moectl.cli import app

runner = CliRunner()
ARGS = ["serve-offload", "--tiny", "olmoe", "--budget", "4", "--max-new-tokens", "4", "--policy", "option:4"]


def _row(output: str, measure: str) -> str:
    """The table cell right of ``measure``."""
    line = next(line for line in output.splitlines() if measure in line)
    return line.split("│")[2].strip()


def test_table_gives_the_switch_rate_and_the_timeline(tmp_path):
    result = runner.invoke(app, [*ARGS, "--plot", str(tmp_path / "t.png")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert 0.0 <= float(_row(result.output, "switch rate of the resident option")) <= 1.0
    assert _row(result.output, "load timeline (PNG)") == str(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_table_says_why_a_switch_rate_is_missing_and_that_no_timeline_was_written():
    """Batched decoding and LRU have no per-prompt option to count: the cell says so, not a bare '-'."""
    batched = runner.invoke(app, [*ARGS, "--max-batch", "2"], env={"COLUMNS": "200"})
    assert batched.exit_code == 0, batched.output
    assert "--max-batch 1" in _row(batched.output, "switch rate of the resident option")
    assert _row(batched.output, "load timeline (PNG)") == "not written (--plot PATH writes it)"
    lru = runner.invoke(app, [*ARGS[:-2], "--policy", "lru"], env={"COLUMNS": "200"})
    assert "keeps no option resident" in _row(lru.output, "switch rate of the resident option")
