"""Install extras: every optional module maps to an extra pyproject.toml defines and that lists the
package bringing it; a verb whose extra is missing says so in one line with exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from moectl import extras
from moectl.cli import app
from moectl.cli.extras import PARAMS, VERBS
from moectl.cli.helpformat import FlagCommand
from moectl.errors import MissingExtraError, MoectlError

tomllib = pytest.importorskip("tomllib")
PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
OPTIONAL = PYPROJECT["project"]["optional-dependencies"]
runner = CliRunner()


def _names(extra: str) -> set[str]:
    """The distributions an extra requires, ``moectl[...]`` expanded to the extras it names."""
    names: set[str] = set()
    for line in OPTIONAL[extra]:
        req = Requirement(line)
        if canonicalize_name(req.name) == "moectl":
            for inner in req.extras:
                names |= _names(inner)
        else:
            names.add(canonicalize_name(req.name))
    return names


def _block(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``modules`` unimportable for the test, as if their extra were not installed."""
    for name in modules:
        for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("module", sorted(extras.MODULES))
def test_each_optional_module_names_an_extra_of_pyproject_that_brings_it(module):
    extra, distribution = extras.MODULES[module]
    assert extra in OPTIONAL, f"{module}: extra {extra!r} is not in pyproject.toml"
    assert canonicalize_name(distribution) in _names(extra)


def test_every_extra_brings_its_modules_and_all_brings_every_extra():
    for extra in {e for e, _ in extras.MODULES.values()} | set(extras.ALSO):
        for module in extras.modules_of(extra):
            assert canonicalize_name(extras.MODULES[module][1]) in _names(extra), (extra, module)
    everything = _names("serve") | _names("eval") | _names("train") | _names("plots")
    assert _names("all") == everything
    assert everything <= _names("dev")  # CI installs [dev]: every extra's packages are tested


def test_the_core_pins_no_torch_and_takes_no_extra():
    core = {canonicalize_name(Requirement(line).name): Requirement(line) for line in PYPROJECT["project"]["dependencies"]}
    assert "torch" in core and not any(spec.operator == "==" for spec in core["torch"].specifier)
    optional = {canonicalize_name(dist) for _, dist in extras.MODULES.values()}
    assert not optional & set(core), "a package of an extra is also in the core"


def _commands(group: Any, prefix: str = "") -> dict[str, Any]:
    """Every command and group under ``group`` by its path (typer carries its own click: a group
    is what has ``commands``)."""
    out: dict[str, Any] = {}
    for name, command in group.commands.items():
        path = f"{prefix}{name}"
        out[path] = command
        if hasattr(command, "commands"):
            out |= _commands(command, f"{path} ")
    return out


def test_each_verb_of_the_mapping_exists_and_its_extra_too():
    commands = _commands(typer.main.get_command(app))
    for verb, extra in VERBS.items():
        assert verb in commands and not hasattr(commands[verb], "commands"), verb
        assert extra in OPTIONAL
    assert set(PARAMS.values()) <= set(OPTIONAL)


def test_a_verb_without_its_extra_says_so_in_one_line_with_exit_2(monkeypatch):
    _block(monkeypatch, "fastapi")
    result = runner.invoke(app, ["serve", "--tiny", "olmoe"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: moectl serve needs the serve extra: pip install 'moectl[serve]'"
    assert result.stdout == ""


def test_a_nested_verb_and_a_plot_flag_name_their_extra(monkeypatch, tmp_path):
    _block(monkeypatch, "optuna")
    result = runner.invoke(app, ["roe", "tune", "tiny:olmoe", "--data", "x.jsonl", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: moectl roe tune needs the train extra: pip install 'moectl[train]'"
    _block(monkeypatch, "matplotlib")
    result = runner.invoke(app, ["switch-rate", "--tiny", "olmoe", "--plot", str(tmp_path / "plots")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: moectl switch-rate needs the plots extra: pip install 'moectl[plots]'"


def test_help_answers_without_the_extra(monkeypatch):
    _block(monkeypatch, "fastapi", "uvicorn")
    result = runner.invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--routing" in result.stdout


def test_a_module_found_missing_inside_a_verb_ends_it_in_the_same_line(monkeypatch):
    """The fallback: a verb not in the mapping that imports an optional module mid-run."""
    tool = typer.Typer()

    @tool.command("draw", cls=FlagCommand)
    def draw() -> None:
        import matplotlib.figure  # noqa: F401

    @tool.command("other", cls=FlagCommand)
    def other() -> None:
        import moectl_no_such_module  # noqa: F401 - not an optional module: a bug, kept as it is

    _block(monkeypatch, "matplotlib")
    result = runner.invoke(tool, ["draw"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: moectl draw needs the plots extra: pip install 'moectl[plots]'"
    result = runner.invoke(tool, ["other"])
    assert isinstance(result.exception, ModuleNotFoundError) and result.exit_code == 1


def test_library_functions_raise_a_moectl_error_naming_the_extra(monkeypatch):
    from moectl.server import ServeConfig

    _block(monkeypatch, "uvicorn")
    monkeypatch.delitem(sys.modules, "moectl.server.uvicorn_run", raising=False)
    with pytest.raises(MissingExtraError, match=r"needs the serve extra: pip install 'moectl\[serve\]'") as caught:
        ServeConfig(model="tiny:olmoe")
    assert isinstance(caught.value, MoectlError) and isinstance(caught.value, ModuleNotFoundError)
    assert caught.value.name == "uvicorn"
    _block(monkeypatch, "lm_eval")
    with pytest.raises(MissingExtraError, match=r"^moectl.eval.evaluate needs the eval extra: pip install 'moectl\[eval\]'$"):
        extras.require("eval", "moectl.eval.evaluate")


def test_missing_extra_tells_a_missing_package_from_a_version_mismatch(monkeypatch):
    assert extras.missing_extra(ModuleNotFoundError("x", name="matplotlib.figure")) is None  # installed: a bug
    assert extras.missing_extra(ModuleNotFoundError("x", name="json")) is None  # not optional
    assert extras.missing_extra(ValueError("x")) is None
    _block(monkeypatch, "matplotlib")
    assert extras.missing_extra(ModuleNotFoundError("x", name="matplotlib.figure")) == "plots"
    assert extras.missing_modules("train") == ["matplotlib"]
    assert extras.message("moectl demo", "plots") == "moectl demo needs the plots extra: pip install 'moectl[plots]'"


def test_the_demo_runs_on_the_core_and_names_the_extra_its_figure_needs(monkeypatch, tmp_path):
    _block(monkeypatch, "matplotlib")
    out = tmp_path / "demo"
    result = runner.invoke(app, ["demo", "--max-new-tokens", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "needs the plots extra: pip install 'moectl[plots]'" in result.stdout
    assert not out.exists() or not any(out.iterdir())
