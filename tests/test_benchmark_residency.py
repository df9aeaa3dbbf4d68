"""benchmarks/residency_simulate.py and residency_reference.py end to end on small inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import residency_reference
import residency_simulate


def test_speed_benchmark_rows(tmp_path, capsys):
    out = tmp_path / "speed.json"
    doc = residency_simulate.main(
        ["--tokens", "300", "--layers", "2", "--top-k", "2", "--experts", "8", "--budget", "4", "--json", str(out)]
    )
    assert json.loads(out.read_text())["accesses"] == doc["accesses"] == 300 * 2 * 2
    rows = {r["policy"]: r for r in doc["results"]}
    assert set(rows) == {"lru", "lfu", "lfuda", "arc", "s3fifo", "least-stale", "static", "belady"}
    assert all(r["accesses_per_s"] > 0 and r["hit_rate"] <= rows["belady"]["hit_rate"] for r in rows.values())
    assert "accesses/s" in capsys.readouterr().out


def test_skewed_draws_are_distinct_and_skewed():
    chosen = residency_simulate.synthetic(2000, 1, 2, 8, 1.5, 0)
    assert (chosen[..., 0] != chosen[..., 1]).all()
    counts = sorted((chosen == e).sum() for e in range(8))
    assert counts[-1] > 3 * counts[0]  # Zipf(1.5): the favourite expert far above the least used


def test_reference_benchmark_records_and_replays(tmp_path):
    doc = residency_reference.main(
        ["--model", "tiny:olmoe", "--docs", "2", "--chars", "30", "--max-new-tokens", "4", "--budget", "2,4",
         "--routing", "random weights: tiny:olmoe", "--out", str(tmp_path)]
    )  # fmt: skip
    assert doc["trace"]["layers"] == 3 and doc["trace"]["routing"].startswith("random weights: tiny:olmoe; 2 corpus")
    assert {r["budget"] for r in doc["results"]} == {2, 4}
    assert (tmp_path / "hit_rate.png").is_file()


def test_reroute_benchmark_rows(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import reroute

    out = tmp_path / "reroute.json"
    rows = reroute.main(
        ["--model", "tiny:olmoe", "--prompts", "2", "--chars", "20", "--max-new-tokens", "6", "--budget", "4",
         "--tols", "0,1", "--json", str(out)]
    )  # fmt: skip
    assert [r["policy"] for r in rows] == ["s3fifo", "reroute:0", "reroute:1"]
    assert rows[0]["same_tokens"] == rows[1]["same_tokens"] == 1.0 and rows[1]["rerouted_per_token"] == 0
    assert rows[2]["rerouted_per_token"] > 0 and rows[2]["hit_rate"] > rows[0]["hit_rate"]
    assert json.loads(out.read_text())["rows"][2]["policy"] == "reroute:1"
