"""benchmarks/master_weights.py end to end on a tiny model: three runs, the table, the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import master_weights


def test_the_benchmark_compares_bf16_with_and_without_masters_to_float32(tmp_path, corpus, capsys):
    out = tmp_path / "mw.json"
    master_weights.main(
        [
            "--model",
            "tiny:qwen2_moe",
            "--corpus",
            str(corpus),
            "--docs",
            "8",
            "--steps",
            "2",
            "--lr",
            "1e-3",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    runs = [r["run"] for r in result["rows"]]
    assert runs == ["float32", "bf16, no masters", "bf16, float32 masters"]
    assert result["rows"][0]["changed"] > 0.9  # float32: every weight moves at lr 1e-3
    assert all(0 <= r["reached_float32"] <= 1 for r in result["rows"][1:])
    assert "reached float32" in capsys.readouterr().out
