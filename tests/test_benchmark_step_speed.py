"""benchmarks/step_ways.py and row_prefetch.py (both ways in one run, the setting restored after) and
rows_bytes.py."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from _bench_helpers import bench, run_json
from moectl.lm import decode_step

step_ways = bench("step_ways")
row_prefetch = bench("row_prefetch")


def test_step_ways_times_both_ways_and_restores_the_setting(tmp_path, monkeypatch):
    args = ["--setting", "guards", "--model", "tiny:qwen2_moe", "--tokens", "3", "--rows", "2", "--threads", "1",
            "--repeats", "1"]  # fmt: skip
    got = run_json(step_ways, args, tmp_path, monkeypatch)
    ways = step_ways.SETTINGS["guards"]
    assert {row["case"] for row in got["rows"]} == {f"{w} {r} row(s) 1 thread(s)" for w in ways for r in (1, 2)}
    assert all(row["tok_s"] > 0 for row in got["rows"]) and got["decode_forward"]["compiled"] > 0
    assert decode_step.ATTENTION == "sums"


def test_step_ways_switches_the_attention_setting(monkeypatch):
    """(Timing the attention setting compiles aten's way's graphs too, ~45 s: its switch is tested alone.)"""
    monkeypatch.setattr(decode_step, "ATTENTION", "sums")
    engine = SimpleNamespace(runner=SimpleNamespace(compiled=None, path="none"))
    put = step_ways.switch("attention", engine)
    put("sdpa")
    assert decode_step.ATTENTION == "sdpa"


def test_row_prefetch_builds_both_variants_and_times_each_shape(tmp_path, monkeypatch):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    got = run_json(row_prefetch, ["--threads", "1", "--megabytes", "1", "--repeats", "1"], tmp_path, monkeypatch)
    assert {(row["shape"], row["way"]) for row in got["rows"]} == {
        (shape, way) for shape in row_prefetch.SHAPES for way in row_prefetch.WAYS
    }
    assert all(row["gb_s"] > 0 for row in got["rows"])


def test_bad_arguments_exit_2(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["row_prefetch", "--threads", "0"])
    with pytest.raises(SystemExit) as exit_:
        row_prefetch.main()
    assert exit_.value.code == 2 and "--threads" in capsys.readouterr().err


def test_rows_bytes_counts_each_steps_distinct_experts(tmp_path, monkeypatch):
    rows_bytes = bench("rows_bytes")
    got = run_json(rows_bytes, ["--model", "tiny:qwen2_moe", "--rows", "3", "--tokens", "3"], tmp_path, monkeypatch)
    assert got["steps"] >= 1 and len(got["distinct_experts"]) >= 1
    assert all(got["top_k"] <= n <= min(3 * got["top_k"], got["num_experts"]) for n in got["distinct_experts"])
    assert got["one_row_bytes"] < got["rows_bytes"] and 1 <= got["ceiling_vs_one_row"] <= 3
