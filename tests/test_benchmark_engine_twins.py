"""benchmarks/engine_twins.py on the tiny model: it runs, writes its JSON, and both ways draw the same tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine_twins


def test_the_twins_benchmark_times_both_ways_and_they_agree(tmp_path, monkeypatch):
    out = tmp_path / "twins.json"
    argv = ["engine_twins", "--model", "tiny:olmoe", "--prompt-tokens", "40", "--n", "3", "--max-tokens", "4",
            "--repeat", "1", "--threads", "1", "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    engine_twins.main()
    result = json.loads(out.read_text())
    assert result["same_tokens"] is True and result["n"] == 3
    assert all(len(v) == 1 and v[0] > 0 for v in result["seconds"].values()) and result["speedup"] > 0
