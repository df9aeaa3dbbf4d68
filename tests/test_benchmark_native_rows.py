"""benchmarks/native_rows.py: both row rules through one engine, the rule restored after, a one-line
refusal where the CPU has no native bf16 products."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import native_rows
from moectl.kernels import bf16_rows


def test_both_rules_in_one_run(tmp_path, monkeypatch):
    monkeypatch.setattr(bf16_rows, "native_bf16", lambda: True)
    if not bf16_rows.available():
        pytest.skip("no C compiler: the kernel is not built")
    out = tmp_path / "rows.json"
    argv = ["native_rows", "--model", "tiny:olmoe", "--rows", "3", "--tokens", "3", "--repeats", "1",
            "--threads", "1", "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    native_rows.main()
    got = json.loads(out.read_text())["models"]["tiny:olmoe"]
    assert set(got["decode_tok_s"]) == set(native_rows.RULES) and got["prefill_gain"] > 0 and got["decode_gain"] > 0
    assert native_rows.RULES["few rows (now)"] == (bf16_rows.NATIVE_FEW_ROWS, bf16_rows.NATIVE_SMALL_ROWS)


def test_refused_without_native_bf16(monkeypatch, capsys):
    monkeypatch.setattr(bf16_rows, "native_bf16", lambda: False)
    monkeypatch.setattr(sys, "argv", ["native_rows"])
    with pytest.raises(SystemExit) as exited:
        native_rows.main()
    assert exited.value.code == 2 and "no native bf16" in capsys.readouterr().err
