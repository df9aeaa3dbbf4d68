"""benchmarks/engine_twins.py on the tiny model: it runs, writes its JSON, and both ways draw the same tokens."""

from __future__ import annotations

from _bench_helpers import bench, run_json

engine_twins = bench("engine_twins")


def test_the_twins_benchmark_times_both_ways_and_they_agree(tmp_path, monkeypatch):
    args = ["--model", "tiny:olmoe", "--prompt-tokens", "40", "--n", "3", "--max-tokens", "4", "--repeat", "1",
            "--threads", "1"]  # fmt: skip
    result = run_json(engine_twins, args, tmp_path, monkeypatch)
    assert result["same_tokens"] is True and result["n"] == 3
    assert all(len(v) == 1 and v[0] > 0 for v in result["seconds"].values()) and result["speedup"] > 0
