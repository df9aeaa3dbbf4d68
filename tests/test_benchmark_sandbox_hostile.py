"""benchmarks/sandbox_hostile.py end to end: three hostile programs, an honest one, one timing repeat."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sandbox_hostile


def test_the_benchmark_counts_and_times(tmp_path, capsys):
    out = tmp_path / "sandbox.json"
    import moectl.eval.code_exec as current

    names = "sys.exit(0),infinite loop,__eq__ always true,right: a + b"
    argv = ["--hostile", names, "--repeats", "1", "--previous", current.__file__]
    sandbox_hostile.main([*argv, "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["tried"] == 3 and doc["contained"] == 3 and doc["fake_passes"] == 0 and doc["breaches"] == {}
    assert doc["honest_tried"] == doc["honest_right"] == 1 and doc["statuses"]["right: a + b"] == "passed"
    assert set(doc["seconds_per_hostile_program"]) == set(names.split(","))
    assert {"bare python -I", "previous code_exec", "sandbox (basic)"} <= set(
        doc["median_seconds_per_program"]
    )
    assert f"sandbox ({doc['containment']})" in doc["median_seconds_per_program"]
    assert (doc["cgroup_ms_per_program"] is None) == doc["memory_bound"].startswith("rlimits")
    out_text = capsys.readouterr().out
    assert "hostile programs: 3 tried, 3 contained, 0 fake passes" in out_text
    assert "honest programs: 1 tried, 1 scored right" in out_text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hostile", "rm -rf"], "error: --hostile: unknown rm -rf; known: fork bomb,"),
        (["--previous", "no/such/code_exec.py"], "error: --previous: no/such/code_exec.py is not a file"),
        (["--repeats", "0"], "error: --repeats must be at least 1, got 0"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        sandbox_hostile.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err
