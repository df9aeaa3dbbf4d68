"""`accelerate launch -m moectl pretrain` on two CPU processes trains one data-parallel run to the end."""

from __future__ import annotations

import json

from _distributed import check, launch


def test_pretrain_on_two_processes_finishes_and_counts_both(tmp_path):
    done = launch(["pretrain", "--preset", "tiny", "--max-steps", "2", "--out", str(tmp_path / "run")], tmp_path)
    check(done)  # the final checkpoint's barrier is reached by every process (it hung on rank 0 only)
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    per_process = config["micro_batch"] * config["grad_accum"] * config["seq_len"]
    steps = [r for r in rows if "final" not in r]
    assert steps[-1]["tokens"] == 2 * 2 * per_process  # 2 steps x 2 processes
    assert rows[-1]["final"] and (tmp_path / "run" / "final" / "config.json").is_file()
