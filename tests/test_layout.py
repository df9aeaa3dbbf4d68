"""The package layout docs/architecture.md describes, checked on the source tree (issue #30).

- Names are unique: outside ``cli/`` (whose modules are named after their command groups) no two
  library modules share a file name, so a file name says which module is meant.
- Imports point one way, down: ``io/`` imports no other moectl package (``moectl.errors`` only);
  the offload runtime (``offload/``) sits below the engine and imports neither ``engine/``, nor
  ``server/``, nor ``cli/``; ``engine/`` imports neither ``server/`` nor ``cli/``; no library package
  imports ``cli/``. Every import counts, also one inside a function (a lazy import is still a
  dependency).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moectl"
ENTRY_POINTS = {"__init__.py", "__main__.py"}
# top-level modules that are command-line entry points: they run cli/ (not library code)
CLI_ENTRIES = {"__main__.py", "pretrain.py"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _package_of(path: Path) -> str | None:
    """The moectl subpackage ``path`` belongs to (``"io"``, ``"offload"``), None for a top-level module."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else None


def _imports(path: Path, source: str | None = None) -> set[str]:
    """Every moectl module ``path`` imports (absolute, at any depth; relative imports resolved);
    ``source``: read instead of the file (as if it were at ``path``)."""
    text = path.read_text(encoding="utf-8") if source is None else source
    tree = ast.parse(text, filename=str(path))
    here = ["moectl", *path.relative_to(PACKAGE).with_suffix("").parts]
    if path.name == "__init__.py":
        here = here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "moectl"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + (1 if path.name == "__init__.py" else 0)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.split(".")[0] == "moectl":
                found.add(module)
                found |= {f"{module}.{a.name}" for a in node.names}
    return found


def _packages_imported(path: Path, source: str | None = None) -> set[str]:
    """The moectl subpackages and top-level modules ``path`` imports: ``moectl.engine.kv`` -> ``engine``."""
    return {name.split(".")[1] for name in _imports(path, source) if name.count(".") >= 1}


def test_no_two_library_modules_share_a_file_name():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        if path.name in ENTRY_POINTS or _package_of(path) == "cli":
            continue
        seen[path.name].append(str(path.relative_to(PACKAGE)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"module file names used more than once outside cli/: {shared}"


def test_the_checks_see_the_tree():
    """The walk finds the packages the rules name (a moved tree would make the rules vacuous)."""
    packages = {_package_of(p) for p in _modules()}
    assert {"io", "offload", "engine", "server", "cli", "reporting", "routing"} <= packages
    assert "serve" not in packages, "serve/ is gone: the runtime is offload/, serve-offload server/offload_batch.py"
    assert "engine" in _packages_imported(PACKAGE / "server" / "offload_batch.py")
    assert _imports(PACKAGE / "io" / "pip_download.py") == {"moectl.errors", "moectl.errors.FetchError"}


# package -> the moectl packages it must not import
FORBIDDEN = {
    "offload": {"engine", "server", "cli"},
    "engine": {"server", "cli"},
}


@pytest.mark.parametrize("path", [p for p in _modules() if _package_of(p) == "io"], ids=lambda p: p.name)
def test_io_imports_no_other_moectl_package(path):
    others = _packages_imported(path) - {"io", "errors"}
    assert not others, f"io/{path.name} imports {sorted(others)}: io/ sits below everything (moectl.errors only)"


@pytest.mark.parametrize("path", [p for p in _modules() if _package_of(p) == "kernels"], ids=lambda p: p.name)
def test_kernels_import_no_other_moectl_package(path):
    others = _packages_imported(path) - {"kernels"}
    assert not others, f"kernels/{path.name} imports {sorted(others)}: kernels/ sits below everything, beside io/"


@pytest.mark.parametrize(
    "path", [p for p in _modules() if _package_of(p) in FORBIDDEN], ids=lambda p: "/".join(p.parts[-2:])
)
def test_imports_point_down(path):
    package = _package_of(path)
    wrong = _packages_imported(path) & FORBIDDEN[package]
    assert not wrong, f"{package}/{path.name} imports {sorted(wrong)}, a package above it"


def test_no_library_module_imports_the_command_line():
    importers = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if _package_of(p) != "cli"
        and not (_package_of(p) is None and p.name in CLI_ENTRIES)
        and "cli" in _packages_imported(p)
    ]
    assert not importers, f"library modules importing moectl.cli: {importers}"


def test_the_checks_catch_a_wrong_import():
    """The import reader sees absolute, lazy and relative imports (else the rules above check nothing)."""
    source = (
        "import moectl.engine.kv\n"
        "def f():\n    from moectl.server import app\n"
        "from ..cli import common\n"
        "from . import runtime\n"
    )
    found = _packages_imported(PACKAGE / "offload" / "probe.py", source)
    assert found == {"engine", "server", "cli", "offload"}
    assert _packages_imported(PACKAGE / "offload" / "__init__.py", "from .runtime import offload\n") == {"offload"}


def test_every_name_moectl_lists_resolves():
    """``dir(moectl)`` names its lazily imported subpackages: each must still exist after a move
    (``moectl.serve`` listed after serve/ had become offload/ raised ModuleNotFoundError)."""
    import moectl

    for name in dir(moectl):
        getattr(moectl, name)
    assert {"offload", "reporting", "io"} <= set(dir(moectl)) and "serve" not in dir(moectl)
