"""benchmarks/subset_retention.py --methods: the retention table of other selection methods (REAP, ...)
beside the router selection, on two tiny models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import subset_retention


def test_methods_table_rows_and_intervals(tmp_path, capsys):
    out = tmp_path / "retention.json"
    subset_retention.main(
        ["--models", "tiny:olmoe", "tiny:olmoe", "--calib-docs", "1", "--eval-docs", "1", "--max-length", "16",
         "--fractions", "1,0.5", "--methods", "reap,frequency", "--iters", "50", "--json", str(out),
         "--plot", str(tmp_path / "fig.png")]
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["settings"]["methods"] == ["router", "reap", "frequency"]
    half = doc["summary"]["0.5"]["methods"]
    assert set(half) == {"router", "reap", "frequency"}
    for method, cells in half.items():
        for name in ("standard", "emo"):
            cell = cells[name]
            lo, hi = cell["ci95"]
            assert lo <= cell["relative"] <= hi
            assert ("minus_router" in cell) == (method != "router")
    # the router row of the table is the figure's router summary
    assert half["router"]["standard"]["relative"] == doc["summary"]["0.5"]["standard"]["relative"]
    # all experts kept: every method is the full model
    assert all(c["relative"] == 0 for cells in doc["summary"]["1"]["methods"].values() for c in cells.values())
    # the same model twice: both columns agree, per method
    assert half["reap"]["standard"] == half["reap"]["emo"]
    domain = next(iter(doc["results"]["standard"].values()))
    assert set(domain["0.5"]["methods"]) == {"reap", "frequency"}
    assert "reap" in capsys.readouterr().out
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the methods drawn beside router


def test_unknown_method_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        subset_retention.main(["--models", "a", "b", "--methods", "router,magic"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--methods: unknown selection method 'magic'" in err and "reap" in err and err.count("\n") == 1
