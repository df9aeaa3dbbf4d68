"""benchmarks/native_rows.py: both row rules through one engine, the rule restored after, a one-line
refusal where the CPU has no native bf16 products."""

from __future__ import annotations

import sys

import pytest

from _bench_helpers import bench, run_json
from moectl.kernels import bf16_rows

native_rows = bench("native_rows")


def test_both_rules_in_one_run(tmp_path, monkeypatch):
    monkeypatch.setattr(bf16_rows, "native_bf16", lambda: True)
    if not bf16_rows.available():
        pytest.skip("no C compiler: the kernel is not built")
    args = ["--model", "tiny:olmoe", "--rows", "3", "--tokens", "3", "--repeats", "1", "--threads", "1"]
    got = run_json(native_rows, args, tmp_path, monkeypatch)["models"]["tiny:olmoe"]
    assert set(got["decode_tok_s"]) == set(native_rows.RULES) and got["prefill_gain"] > 0 and got["decode_gain"] > 0
    assert native_rows.RULES["few rows (now)"] == (bf16_rows.NATIVE_FEW_ROWS, bf16_rows.NATIVE_SMALL_ROWS)


def test_refused_without_native_bf16(monkeypatch, capsys):
    monkeypatch.setattr(bf16_rows, "native_bf16", lambda: False)
    monkeypatch.setattr(sys, "argv", ["native_rows"])
    with pytest.raises(SystemExit) as exited:
        native_rows.main()
    assert exited.value.code == 2 and "no native bf16" in capsys.readouterr().err
