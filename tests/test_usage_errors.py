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


@pytest.mark.parametrize(
    "args",
    [
        ["eval", "tiny:olmoe", "--tasks"],  # an option without its value
        ["eval", "tiny:olmoe", "--limit", "x"],  # a bad type
        ["roe", "tune", "--tiny", "olmoe", "--max-docs", "0"],  # out of range
        ["subset", "select", "tiny:olmoe"],  # a missing option
        ["options", "train", "tiny:olmoe", "--k-hat", "4"],
        ["card"],  # a missing argument
        ["inspect", "a", "b"],  # an extra argument
        ["subset", "nosuchverb"],  # an unknown verb of a group
        ["serve", "--port", "abc"],
        ["pretrain", "--max-steps", "x"],
        ["pretrain", "--bogus"],
        ["offload", "simulate", "x.npy", "--bogus"],
    ],
)  # fmt: skip
def test_usage_errors_of_every_kind_are_one_line(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Usage:" not in result.output and "╭" not in result.output


# Pasted as a verb's --help writes it, a placeholder (MODEL, TRACE, FAMILY, prompts.jsonl, option:K,
# K=16,tau=0.5 with its values as letters, ...) is refused in one line naming what is expected,
# never a traceback, never taken as a default (issue #43 item 2).
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["inspect", "tiny:FAMILY"], "no tiny config for family 'FAMILY'; choose one of: olmoe"),
        (["inspect", "MODEL"], "'MODEL' is neither a checkpoint directory nor a hub id"),
        (["switch-rate", "--tiny", "olmoe", "--prompts", "prompts.jsonl"], "prompts file prompts.jsonl does not exist"),
        (["switch-rate", "--tiny", "olmoe", "--policy", "option:K_HAT"], "option needs an integer k-hat, as option:8"),
        (["offload", "simulate", "TRACE", "--num-experts", "8"], "TRACE: no moectl trace there"),
        (["offload", "simulate", "trace.npy", "--num-experts", "8"], "trace.npy: no such file"),
        (["eval", "tiny:olmoe", "--perplexity", "CORPUS"], "corpus CORPUS does not exist"),
        (["eval", "tiny:olmoe", "--roe", "K=K,tau=TAU", "--perplexity", "c.jsonl"], "--roe: K must be an integer, got 'K'"),
        (["eval", "tiny:olmoe", "--roe", "K=16,tau=TAU", "--perplexity", "c.jsonl"], "--roe: tau must be a number"),
        (["eval", "tiny:olmoe", "--policy", "option:K", "--perplexity", "c.jsonl"], "option needs an integer k-hat"),
        (["eval", "tiny:olmoe", "--controller", "DIR", "--perplexity", "c.jsonl"], "DIR: not a controller folder"),
        (["subset", "select", "MODEL", "--data", "math_val.jsonl", "--keep", "8", "--out", "math.subset.json"],
         "math_val.jsonl cannot be read"),
        (["roe", "generate", "--tiny", "olmoe", "--tau", "profile.json", "--prompt", "x"], "tau profile profile.json does not exist"),
        (["serve-offload", "--tiny", "olmoe", "--policy", "reroute:TOL"], "reroute needs a tolerance, as reroute:0.05"),
        (["serve-offload", "--tiny", "olmoe", "--policy", "static:SUBSET.json"], "subset file SUBSET.json does not exist"),
        (["serve", "--tiny", "olmoe", "--routing", "NAME=SPEC"], "unknown policy 'SPEC'"),
        (["checkpoint", "make", "shape:NAME[~wWIDTH]", "--out", "x"], "expected shape:NAME[@LAYERS][~wWIDTH], e.g."),
        (["card", "MODEL_DIR", "--run", "RUN"], "MODEL_DIR: no such model folder"),
        (["report", "FILES"], "results file FILES does not exist"),
        (["tokenizer", "train", "CORPUS_DIR"], "corpus folder CORPUS_DIR does not exist"),
        (["options", "card", "RUN", "--base", "BASE", "--out", "OUT"], "RUN: no such run folder"),
        (["export", "gguf", "MODEL", "--out", "OUT"], "MODEL is not a checkpoint folder"),
        (["modularity", "MODEL", "--data", "domains/", "--out", "report/"], "domains does not exist"),
        (["pretrain", "--corpus", "CORPUS", "--out", "run"], "corpus CORPUS does not exist"),
    ],
)  # fmt: skip
def test_a_placeholder_pasted_from_help_is_refused_in_one_line(args, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"text": "a b c", "domain": "d"}\n')
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "report").exists()  # nothing written


def test_a_verb_run_alone_gives_the_same_one_line(monkeypatch, capsys):
    """``python -m moectl.pretrain`` (what ``accelerate launch -m`` runs) is typer.run, outside the group."""
    import sys

    from moectl.cli.common import run_alone
    from moectl.cli.pretrain import pretrain_command

    for args, line in [(["--max-steps", "x"], "error: Invalid value for '--max-steps'"),
                       (["--bogus"], "error: No such option: --bogus")]:  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["python -m moectl.pretrain", *args])
        with pytest.raises(SystemExit) as stop:
            run_alone(pretrain_command)
        assert stop.value.code == 2
        captured = capsys.readouterr()
        assert captured.err.strip().startswith(line) and len(captured.err.strip().splitlines()) == 1
        assert "Usage:" not in captured.out + captured.err
