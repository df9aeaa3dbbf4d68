"""The package layout docs/architecture.md describes, checked on the source tree (issues #30, #39).

- Names are unique: outside ``cli/`` (whose modules are named after their command groups) no two
  library modules share a file name, so a file name says which module is meant.
- Imports point one way, down the ladder the architecture page draws (``LADDER``, read from the
  page): every package and top-level module is on it, and each imports only those at its level or
  below, but for the few upward imports ``KNOWN_UPWARD`` names (each must still exist: fixed, it
  leaves the list). No two packages import each other, directly or round a cycle.
- The ends, checked on their own: ``io/`` imports no other moectl package (``moectl.errors`` only);
  the offload runtime (``offload/``) sits below the engine and imports neither ``engine/``, nor
  ``server/``, nor ``cli/``; ``engine/`` imports neither ``server/`` nor ``cli/``; no library package
  imports ``cli/``.

Every import counts, also one inside a function or under ``TYPE_CHECKING`` (a lazy import is still
a dependency).
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "moectl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
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


# --- the ladder (issue #39) ------------------------------------------------------------------------


def _unit(path: Path) -> str:
    """What ``path`` is on the ladder: its subpackage (``"engine"``), or a top-level module's stem
    (``"generate"``; ``moectl/__init__.py`` is ``"__init__"``)."""
    return _package_of(path) or path.stem


def _read_ladder(text: str) -> list[tuple[str, ...]]:
    """The ladder block of the architecture page, bottom level first: after the line that names
    ``tests/test_layout.py``, one fenced line per level, top first, ``N  name, name, ...``."""
    after = text.split("(`tests/test_layout.py` reads this block)", 1)[1]
    block = after.split("```", 2)[1]
    levels: dict[int, tuple[str, ...]] = {}
    for line in block.splitlines():
        m = re.fullmatch(r"\s*(\d+)\s+(.+?)\s*", line)
        if m:
            levels[int(m.group(1))] = tuple(name.strip() for name in m.group(2).split(","))
    assert sorted(levels) == list(range(1, len(levels) + 1)), f"ladder levels must be 1..N: {sorted(levels)}"
    return [levels[n] for n in sorted(levels)]


LADDER = _read_ladder(ARCHITECTURE.read_text(encoding="utf-8"))
LEVEL = {name: n for n, level in enumerate(LADDER, 1) for name in level}

# The imports that still point up the ladder (module -> the package above it), each with why. Fixing
# one removes it here (test_known_upward_imports_still_exist fails until it is removed).
KNOWN_UPWARD: dict[tuple[str, str], str] = {
    ("offload/residency.py", "options"): "the controller residency policy builds options' ControllerPolicy",
    ("offload/loading.py", "options"): "a controller folder's k_hat, found by options.option_state",
    ("reporting/eval_plots.py", "eval"): "the report figure rebuilds eval.report's table rows",
    ("reporting/roe_plots.py", "roe"): "roe.tune.TuneResult named in an annotation (TYPE_CHECKING)",
    ("reporting/controller_card.py", "train"): "a controller card reads train.checkpoint's checkpoints",
}


def _edges() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> the modules of ``unit`` that import it (other units only, the known
    upward imports left out)."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in _modules():
        rel, unit = str(path.relative_to(PACKAGE)), _unit(path)
        for other in _packages_imported(path):
            if other != unit and (rel, other) not in KNOWN_UPWARD:
                edges[unit][other].append(rel)
    return edges


def _cycle(graph: dict[str, set[str]] | dict[str, dict]) -> list[str] | None:
    """One cycle of ``graph`` (``[a, b, ..., a]``), None if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_ladder_places_every_package_once():
    placed = [name for level in LADDER for name in level]
    twice = sorted({name for name in placed if placed.count(name) > 1})
    assert not twice, f"on the ladder twice: {twice}"
    units = {_unit(p) for p in _modules()}
    assert units - set(LEVEL) == set(), "packages missing from the ladder in docs/architecture.md"
    assert set(LEVEL) - units == set(), "the ladder in docs/architecture.md names packages that do not exist"
    assert {"lm", "ensemble", "engine", "roe", "eval"} <= units


def test_the_ladder_puts_lm_below_engine_eval_and_roe_and_the_ensemble_below_the_engine():
    assert LEVEL["lm"] < min(LEVEL["engine"], LEVEL["eval"], LEVEL["roe"], LEVEL["ensemble"])
    assert LEVEL["ensemble"] < LEVEL["engine"] < LEVEL["roe"] <= LEVEL["eval"]
    assert LEVEL["io"] < LEVEL["routing"] < LEVEL["offload"] < LEVEL["engine"]
    assert LEVEL["engine"] < LEVEL["server"] < LEVEL["cli"]


def test_imports_stay_on_the_ladder():
    """Each package (or top-level module) imports only those at its level or below."""
    wrong = []
    for path in _modules():
        rel, unit = str(path.relative_to(PACKAGE)), _unit(path)
        for other in sorted(_packages_imported(path)):
            if other not in LEVEL:
                wrong.append(f"{rel} imports moectl.{other}, which is not on the ladder")
            elif LEVEL[other] > LEVEL[unit] and (rel, other) not in KNOWN_UPWARD:
                wrong.append(f"{rel} (level {LEVEL[unit]}) imports {other} (level {LEVEL[other]})")
    assert not wrong, "imports up the ladder of docs/architecture.md:\n" + "\n".join(wrong)


def test_known_upward_imports_still_exist():
    """A fixed upward import leaves KNOWN_UPWARD (and the architecture page's list)."""
    gone = [
        f"{rel} -> {other}"
        for rel, other in KNOWN_UPWARD
        if not (PACKAGE / rel).exists() or other not in _packages_imported(PACKAGE / rel)
    ]
    assert not gone, f"no longer imported, remove from KNOWN_UPWARD and docs/architecture.md: {gone}"
    text = ARCHITECTURE.read_text(encoding="utf-8")
    unnamed = [rel for rel, _ in KNOWN_UPWARD if f"`{rel}`" not in text]
    assert not unnamed, f"docs/architecture.md names each known upward import: {unnamed}"


def test_no_import_cycle_between_packages():
    edges = _edges()
    cycle = _cycle({unit: set(others) for unit, others in edges.items()})
    if cycle:
        hops = [f"{a} -> {b} ({', '.join(edges[a][b][:3])})" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("packages import each other round a cycle:\n" + "\n".join(hops))


def test_the_cycle_check_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert _cycle({"a": {"a"}}) == ["a", "a"]
    ladder = _read_ladder("(`tests/test_layout.py` reads this block)\n```\n 2  b, c\n 1  a\n```\n")
    assert ladder == [("a",), ("b", "c")]
