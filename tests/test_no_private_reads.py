"""No package of moectl reads another package's private names (issue #30): what one package uses of
another is its public API. Scanned with ``ast`` over src/moectl, three ways:

- ``from moectl.B... import _name`` in a module of package A != B;
- ``X._name`` (or ``getattr(X, "_name")``) where ``X`` is a name imported from another package, a
  variable or ``self.attr`` assigned from a call of one (``x = B.Thing(...)``; ``x._name``);
- ``self._name`` in a class of package A that derives from a class of package B, where the class
  never defines ``_name`` itself (an inherited private).

A package is the first component below ``moectl`` (``moectl.offload.offload`` -> ``serve``); a
top-level module is a package of its own. Privates of other libraries (torch, transformers) are
not moectl's and are not scanned.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import moectl

ROOT = Path(moectl.__file__).parent

# (file relative to src/moectl, the private name) -> why it is read across packages
ALLOWED: dict[tuple[str, str], str] = {}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _key(node: ast.expr) -> str | None:
    """``x`` for a name, ``self.x`` for an attribute of self, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def private_reads(path: Path) -> list[tuple[int, str, str]]:
    """``(line, private name, what it is read from)`` for each cross-package private read in ``path``."""
    module = ".".join(("moectl", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
    mine = _package(module)
    tree = ast.parse(path.read_text())
    found: list[tuple[int, str, str]] = []
    foreign: dict[str, str] = {}  # local name -> the other package's object it is
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "moectl":
            for alias in node.names:
                source = _package(node.module) if node.module != "moectl" else alias.name
                if source == mine:
                    continue
                foreign[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                if _private(alias.name):
                    found.append((node.lineno, alias.name, node.module))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "moectl" and _package(alias.name) != mine:
                    foreign[alias.asname or alias.name.split(".")[0]] = alias.name
    bound = dict(foreign)
    for node in ast.walk(tree):  # names assigned from a call of another package's object
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            root = _root_name(node.value)
            if root in foreign:
                for target in node.targets:
                    key = _key(target)
                    if key is not None and key not in foreign:
                        bound.setdefault(key, f"{foreign[root]}(...)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            key = _key(node.value)
            if key in bound:
                found.append((node.lineno, node.attr, bound[key]))
        elif (  # getattr / hasattr (X, "_name")
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and _key(node.args[0]) in bound
        ):
            found.append((node.lineno, node.args[1].value, bound[_key(node.args[0])]))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = [foreign[r] for r in map(_root_name, cls.bases) if r in foreign]
        if not bases:
            continue
        own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        own |= {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign)) for t in
                (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute) and _key(target) is not None:
                        own.add(target.attr)
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and _private(node.attr)
                and node.attr not in own
            ):
                found.append((node.lineno, node.attr, f"a base of {cls.name} ({', '.join(bases)})"))
    return found


def test_no_package_reads_another_packages_privates():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for line, name, source in private_reads(path):
            if (rel, name) not in ALLOWED:
                bad.append(f"{rel}:{line}: {name} of {source}")
    assert not bad, "private names read across packages (make them public API):\n" + "\n".join(bad)


def test_the_scan_finds_each_kind(tmp_path, monkeypatch):
    """The scanner is not vacuous: a module with each kind of read is reported, line by line."""
    package = tmp_path / "moectl" / "mine"
    package.mkdir(parents=True)
    (package / "bad.py").write_text(
        "from moectl.routing.policy_files import _secret\n"
        "from moectl.options.policy import ControllerPolicy\n"
        "from moectl.routing import gumbel\n"
        "from moectl.mine.other import _fine\n"
        "def f(p):\n"
        "    policy = ControllerPolicy(p)\n"
        "    return policy._option, gumbel._noise, ControllerPolicy._x, p._not_known, getattr(policy, '_y')\n"
        "class Sub(ControllerPolicy):\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def g(self):\n"
        "        return self._mine, self._started\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "moectl")
    found = sorted(private_reads(package / "bad.py"))
    assert [(line, name) for line, name, _ in found] == [
        (1, "_secret"), (7, "_noise"), (7, "_option"), (7, "_x"), (7, "_y"), (12, "_started")
    ]
