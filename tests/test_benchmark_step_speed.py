"""benchmarks/step_attention.py and row_prefetch.py: both ways in one run, the setting restored after."""

from __future__ import annotations

import shutil

import pytest

from _bench_helpers import bench, run_json
from moectl.lm import decode_step

step_attention = bench("step_attention")
row_prefetch = bench("row_prefetch")


def test_step_attention_times_both_ways_and_restores_the_setting(tmp_path, monkeypatch):
    args = ["--model", "tiny:qwen2_moe", "--tokens", "3", "--rows", "2", "--threads", "1", "--repeats", "1"]
    got = run_json(step_attention, args, tmp_path, monkeypatch)
    cases = {row["case"] for row in got["rows"]}
    assert cases == {f"{way} {rows} row(s) 1 thread(s)" for way in ("sdpa", "sums") for rows in (1, 2)}
    assert all(row["tok_s"] > 0 for row in got["rows"]) and got["decode_forward"]["compiled"] > 0
    assert decode_step.ATTENTION == "sums"


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
