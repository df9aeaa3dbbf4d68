"""benchmarks/sandbox_hostile.py end to end on two hostile programs and one timing repeat."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sandbox_hostile


def test_the_benchmark_counts_and_times(tmp_path, capsys):
    out = tmp_path / "sandbox.json"
    sandbox_hostile.main(["--hostile", "sys.exit(0),infinite loop", "--repeats", "1", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["tried"] == 2 and doc["contained"] == 2 and doc["breaches"] == {}
    assert set(doc["seconds_per_hostile_program"]) == {"sys.exit(0)", "infinite loop"}
    assert "bare python -I" in doc["median_seconds_per_program"]
    assert f"sandbox ({doc['containment']})" in doc["median_seconds_per_program"]
    assert "hostile programs: 2 tried, 2 contained" in capsys.readouterr().out


def test_unknown_hostile_name_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        sandbox_hostile.main(["--hostile", "rm -rf"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --hostile: unknown rm -rf; known: fork bomb,") and "\n" not in err
