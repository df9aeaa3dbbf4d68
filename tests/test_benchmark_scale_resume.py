"""benchmarks/scale.py keeps what it measured: the results file after every row, and a stopped run
resumed with ``--merge --skip-measured`` (the rows themselves run in benchmarks, not in tests)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale


def _args(path: Path, **sizes: int) -> argparse.Namespace:
    values = {key: default for key, (default, _) in scale.SIZES.items()} | sizes
    return argparse.Namespace(json=path, merge=True, skip_measured=True, **values)


def test_saved_rows_merge_and_are_skipped_only_at_the_same_sizes(tmp_path):
    path = tmp_path / "scale.json"
    args = _args(path)
    old = {"shape": "olmoe-1b-7b@2", "row": "trace", "peak_rss": 1, "command": "c"}
    failed = {"shape": "olmoe-1b-7b@2", "row": "scoring", "error": ["boom"], "command": "c"}
    scale._save(args, [old, failed])
    assert not path.with_name("scale.json.tmp").exists()
    assert scale._measured(args) == {("olmoe-1b-7b@2", "trace")}  # a failed row is run again
    assert scale._measured(_args(path, tokens=1024)) == set()  # other sizes: nothing to skip

    new = {"shape": "phi-3.5-moe@2", "row": "trace", "peak_rss": 2, "command": "c"}
    again = {"shape": "olmoe-1b-7b@2", "row": "scoring", "peak_rss": 3, "command": "c"}
    merged = scale._merged(args, [new, again])
    rows = {(r["shape"], r["row"]): r for r in merged}
    assert set(rows) == {("olmoe-1b-7b@2", "trace"), ("olmoe-1b-7b@2", "scoring"), ("phi-3.5-moe@2", "trace")}
    assert rows[("olmoe-1b-7b@2", "scoring")]["peak_rss"] == 3  # the row run now replaces the file's
    scale._save(args, merged)
    assert len(json.loads(path.read_text())["rows"]) == 3
