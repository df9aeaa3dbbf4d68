"""benchmarks/offload_capped.py end to end on the shipped reference model, uncapped: one row per
policy and slot dtype, each a real ``moectl serve-offload`` process whose JSON the row carries."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _module():
    spec = importlib.util.spec_from_file_location("offload_capped", ROOT / "benchmarks" / "offload_capped.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_per_policy_and_slot_dtype(tmp_path):
    out = tmp_path / "capped.json"
    args = ["--checkpoint", str(ROOT / "models" / "moectl-small-standard"), "--caps", "none", "--policies", "lru",
            "--slot-dtypes", "same,int8", "--tokens", "2", "--threads", "1", "--json", str(out)]  # fmt: skip
    assert _module().main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy_label"] for r in rows] == ["lru", "lru, int8 slots"]
    assert all(r["exit"] == 0 and r["generated_tokens"] == 2 for r in rows), rows
    assert [r["config"]["slot_dtype"] for r in rows] == ["same", "int8"]
    same, int8 = rows
    assert int8["resident_expert_bytes"] < 0.6 * same["resident_expert_bytes"]


def test_unknown_slot_dtype_is_refused(capsys):
    args = [
        "--checkpoint",
        str(ROOT / "models" / "moectl-small-standard"),
        "--caps",
        "none",
        "--slot-dtypes",
        "int4",
    ]
    assert _module().main(args) == 2
    assert "--slot-dtypes takes same and int8, got int4" in capsys.readouterr().err
