"""benchmarks/int4_row.py (both ways through one engine, ``int4_row.applies`` restored after) and int4_dp.py."""

from __future__ import annotations

import pytest

from _bench_helpers import bench, run_json
from moectl.kernels import int4_row

int4_row_bench = bench("int4_row")


def test_both_ways_in_one_run(tmp_path, monkeypatch):
    if int4_row._lib() is None:
        pytest.skip("no AVX-512 or no C compiler: the benchmark refuses")
    real = int4_row.applies, int4_row.grouped_applies
    args = ["--model", "tiny:olmoe", "--tokens", "3", "--repeats", "1", "--threads", "1"]
    got = run_json(int4_row_bench, args, tmp_path, monkeypatch)
    assert set(got["tok_s"]) == {"PyTorch's int4 kernel", "moectl's int4 row loop"} and got["gain"] > 0
    assert (int4_row.applies, int4_row.grouped_applies) == real


def test_int4_dp_builds_both_variants_and_times_each_shape(tmp_path, monkeypatch):
    int4_dp = bench("int4_dp")
    if int4_row._lib() is None:
        pytest.skip("no AVX-512 or no C compiler: the benchmark refuses")
    got = run_json(int4_dp, ["--threads", "1", "--megabytes", "1", "--repeats", "1"], tmp_path, monkeypatch)
    assert {(row["shape"], row["way"]) for row in got["rows"]} == {
        (shape, way) for shape in int4_dp.SHAPES for way in int4_dp.WAYS
    }
    assert all(row["gb_s"] > 0 for row in got["rows"]) and got["group"] == 64
