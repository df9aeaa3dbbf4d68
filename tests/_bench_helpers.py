"""Running a benchmark script's ``main()`` in a test: ``benchmarks/`` importable, argv set, its JSON read back."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench(name: str) -> Any:
    """The script ``benchmarks/NAME.py`` as a module (``benchmarks/`` put on the path first: the
    scripts import their neighbours, ``bench_args``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def run_json(module: Any, args: list[str], tmp_path: Path, monkeypatch) -> dict:
    """``module.main()`` with ``args`` and ``--json`` into ``tmp_path``; the results it wrote."""
    name = module.__name__.rsplit(".", 1)[-1]
    out = tmp_path / f"{name}.json"
    monkeypatch.setattr(sys, "argv", [name, *args, "--json", str(out)])
    module.main()
    return json.loads(out.read_text())
