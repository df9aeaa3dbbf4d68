"""One error base, one CLI handler: every error moectl raises for input it refuses is a
``MoectlError``, and the command line turns one escaping any verb into ``error: MESSAGE``, exit 2."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.cli.common import MoectlGroup
from moectl.errors import ConfigError, MoectlError

runner = CliRunner()

NOT_MOECTL_ERRORS = {
    "APIError": "the HTTP server's refusal of a request: becomes an OpenAI-shaped response, never reaches the CLI",
    "RequestFailed": "carries whatever failed inside an engine step (a bug as often as bad input), type name kept",
    "TrainingInterrupted": "not an error: a stop request after the last checkpoint, handled like Ctrl-C",
    "_Mismatch": "runconfig's private signal between its own functions, never raised to a caller",
    "Overtime": "the sandbox harness's signal to itself; sandbox_bootstrap runs alone, importing nothing of moectl",
    "NotPlainError": "the sandbox harness's verdict of a check (failed), never raised out of the harness process",
    "ProgramError": "the sandbox harness's verdict of a program (error), never raised out of the harness process",
}
"""Exception classes defined in moectl that are not ``MoectlError``, by class name, with why."""


def _moectl_modules() -> list[str]:
    """Every module under src/moectl, by file (``server/`` is a namespace package, which
    ``pkgutil.walk_packages`` does not enter); ``__main__`` runs the command line, so not those."""
    root = Path(moectl.__file__).parent
    return sorted(
        ".".join(("moectl", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for path in root.rglob("*.py")
        if path.name != "__main__.py"
    )


def _moectl_exception_classes() -> dict[str, type]:
    found = {}
    for name in _moectl_modules():
        module = importlib.import_module(name)
        for name, obj in vars(module).items():
            if (
                isinstance(obj, type)
                and issubclass(obj, Exception)
                and not issubclass(obj, Warning)
                and obj.__module__ == module.__name__
            ):
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_error_class_is_a_moectl_error_or_listed_with_a_reason():
    classes = _moectl_exception_classes()
    names = {cls.__name__ for cls in classes.values()}
    assert {"UnsupportedModelError", "ShardError", "BudgetError", "APIError"} <= names  # the walk works
    outside = sorted(
        path
        for path, cls in classes.items()
        if not issubclass(cls, MoectlError) and cls.__name__ not in NOT_MOECTL_ERRORS
    )
    assert outside == [], f"derive these from moectl.errors.MoectlError (or list them with a reason): {outside}"
    assert set(NOT_MOECTL_ERRORS) <= names, "the allow-list names a class that no longer exists"


def test_every_moectl_error_keeps_a_built_in_base():
    """``except ValueError`` (IndexError, OSError, RuntimeError, MemoryError, ImportError: a missing
    extra) written before the base existed still catches."""
    builtin = (ValueError, LookupError, OSError, RuntimeError, MemoryError, ImportError)
    for path, cls in _moectl_exception_classes().items():
        if issubclass(cls, MoectlError) and cls is not MoectlError:
            assert issubclass(cls, builtin), path


def _stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "flag, line",
    [
        (["--dtype", "foo"], "error: --dtype 'foo' is not known: give auto, float32, bfloat16 or float16"),
        (["--device", "foo"], "error: --device 'foo' is not a device: give cpu, cuda, cuda:1, ... (or auto / balanced)"),
    ],
)
def test_a_library_error_inside_a_verb_is_one_line_and_exit_2(flag, line):
    """``--dtype foo`` / ``--device foo`` are refused by the model loader (a ConfigError at the
    source); ``inspect`` has no except block of its own, so the one handler prints it. Before: an
    AttributeError / RuntimeError traceback."""
    result = runner.invoke(app, ["inspect", "--tiny", "olmoe", *flag])
    assert result.exit_code == 2, result.output
    assert _stderr_lines(result) == [line]
    assert result.stdout == ""


def test_the_handler_covers_verbs_inside_groups(tmp_path):
    result = runner.invoke(
        app, ["checkpoint", "make", "shape:olmoe-1b-7b@2", "--out", str(tmp_path / "ck"), "--max-shard-gb", "0"]
    )
    assert result.exit_code == 2, result.output
    assert _stderr_lines(result) == ["error: --max-shard-gb must be > 0, got 0.0"]
    assert not (tmp_path / "ck").exists()


def test_every_verb_group_is_a_moectl_group():
    """Tests and programs invoke a verb group's own app (``subset_app``, ``serve_app``) as well as
    ``app``: each is a ``MoectlGroup``, so the handler is there whichever is invoked."""
    import typer

    groups = {}
    for name in (n for n in _moectl_modules() if n == "moectl.cli" or n.startswith("moectl.cli.")):
        for attr, obj in vars(importlib.import_module(name)).items():
            if isinstance(obj, typer.Typer):
                groups[f"{name}.{attr}"] = obj
    assert "moectl.cli.app" in groups and "moectl.cli.subset.subset_app" in groups
    assert sorted(path for path, group in groups.items() if not issubclass(group.info.cls, MoectlGroup)) == []


def test_a_verb_group_invoked_alone_has_the_handler(tmp_path, monkeypatch):
    """``subset_app`` invoked by itself (as tests/test_subsets_cli.py does): a missing --data file is
    refused by the JSONL reader (MoectlFileError) and printed by the group's handler."""
    from moectl.cli.subset import subset_app

    monkeypatch.chdir(tmp_path)  # short paths: the line fits the console's width wherever tmp_path is
    result = runner.invoke(
        subset_app, ["select", "tiny:olmoe", "--data", "none.jsonl", "--keep", "4", "--out", "s.json"]
    )
    assert result.exit_code == 2, result.output
    assert _stderr_lines(result) == ["error: none.jsonl cannot be read: No such file or directory"]


def test_the_console_script_prints_the_same_line(tmp_path):
    """``main()`` (``python -m moectl``) goes through the same group as ``CliRunner``."""
    done = subprocess.run(
        [sys.executable, "-m", "moectl", "checkpoint", "make", "shape:olmoe-1b-7b@2", "--out", str(tmp_path),
         "--max-shard-gb", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        "error: --max-shard-gb must be > 0, got 0.0"
    ]


@pytest.mark.parametrize("error", [RuntimeError("boom"), ValueError("a plain ValueError is a bug")])
def test_other_exceptions_keep_their_traceback(monkeypatch, error):
    """Only MoectlError is the user's: anything else escapes the handler (exit 1, the exception kept,
    no ``error:`` line), so a bug is reported with its traceback."""
    import moectl.reports

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(moectl.reports, "inspect_report", broken)
    result = runner.invoke(app, ["inspect", "--tiny", "olmoe"])
    assert result.exit_code == 1
    assert result.exception is error
    assert "error:" not in result.output


def test_a_moectl_error_from_anywhere_below_a_verb_is_handled(monkeypatch):
    import moectl.reports

    def refusing(*args, **kwargs):
        raise ConfigError("--knob must be 1..3, got 7")

    monkeypatch.setattr(moectl.reports, "inspect_report", refusing)
    result = runner.invoke(app, ["inspect", "--tiny", "olmoe"])
    assert result.exit_code == 2
    assert _stderr_lines(result) == ["error: --knob must be 1..3, got 7"]


@pytest.mark.parametrize(
    "argv, line",
    [
        (["roe", "score", "--tiny", "olmoe", "--data", "none.jsonl"], "error: data file none.jsonl does not exist"),
        (
            ["roe", "score", "--tiny", "olmoe", "--data", "d.jsonl", "--temperatures", "none.json"],
            "error: tau profile none.json does not exist (write one with `moectl roe tune --out`)",
        ),
        (
            ["options", "train", "tiny:olmoe", "--out", "o", "--k-hat", "99", "--steps", "1"],
            "error: k-hat must be between top-k (2) and the experts per layer (8), got 99",
        ),
        (
            ["eval", "tiny:olmoe", "--perplexity", "bad.jsonl", "--limit", "2"],
            "error: bad.jsonl:1: each line needs a string field 'text' (and optional 'domain')",
        ),
        (
            ["pretrain", "--out", "run", "--preset", "tiny"],
            "error: run already holds a run; continue it with --resume run, or pass --overwrite to start it "
            "again from step 0",
        ),
        (
            ["roe", "score", "--tiny", "olmoe", "--data", "d.jsonl", "--temperatures", "bin.json"],
            "error: bin.json: not a JSON tau profile (not UTF-8 text: invalid start byte)",
        ),
        (
            ["eval", "tiny:olmoe", "--perplexity", "bin.jsonl", "--limit", "2"],
            "error: bin.jsonl: not UTF-8 text (invalid start byte)",
        ),
        (
            ["roe", "bench", "--tiny", "olmoe", "--k", "1,x"],
            "error: --k must be a comma list of integers (e.g. 1,2,4), got '1,x'",
        ),
    ],
    ids=[
        "roe-score-no-data", "roe-score-no-profile", "options-train-k-hat", "eval-bad-corpus",
        "pretrain-run-exists", "roe-profile-not-utf8", "eval-corpus-not-utf8", "roe-bench-k",
    ],
)
def test_verbs_without_a_broad_catch_still_refuse_bad_input_in_one_line(tmp_path, monkeypatch, argv, line):
    """roe, options, eval, pretrain, serve-offload once caught ValueError/OSError/RuntimeError around their
    library calls; the library now raises a MoectlError for each refusal, printed by the one handler."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n')
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    (tmp_path / "bin.json").write_bytes(b"\x80")
    (tmp_path / "bin.jsonl").write_bytes(b"\x80\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert [x for x in _stderr_lines(result) if not x.startswith("moectl: training runs faster")] == [line]


@pytest.mark.parametrize(
    "target, argv",
    [
        ("moectl.roe.score_data.load_items", ["roe", "score", "--tiny", "olmoe", "--data", "d.jsonl"]),
        ("moectl.eval.eval_run.evaluate", ["eval", "tiny:olmoe", "--perplexity", "d.jsonl"]),
        ("moectl.reporting.controller_card.write_controller_card", ["options", "card", ".", "--base", ".", "--out", "c"]),
        ("moectl.server.offload_batch.run", ["serve-offload", "--tiny", "olmoe"]),
    ],
    ids=["roe-score", "eval", "options-card", "serve-offload"],
)
def test_a_plain_value_error_below_these_verbs_keeps_its_traceback(tmp_path, monkeypatch, target, argv):
    """Before: ``handle_moectl_errors(ValueError, OSError, ...)`` around the library call turned any
    ValueError (a bug as often as not) into ``error: ...`` and exit 2; now only MoectlError is."""
    error = ValueError("a plain ValueError is a bug")

    def broken(*args, **kwargs):
        raise error

    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(module), name, broken)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n')
    result = runner.invoke(app, argv)
    assert result.exit_code == 1, result.output
    assert result.exception is error
    assert "error:" not in result.output
