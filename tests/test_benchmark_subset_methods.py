"""benchmarks/subset_retention.py --methods: the retention table of other selection methods (REAP, ...)
beside the router selection, on two tiny models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import subset_retention


def test_methods_table_rows_and_intervals(tmp_path, capsys):
    out = tmp_path / "retention.json"
    subset_retention.main(
        ["--models", "tiny:olmoe", "tiny:olmoe", "--calib-docs", "1", "--eval-docs", "1", "--max-length", "16",
         "--fractions", "1,0.5", "--methods", "reap,frequency", "--iters", "50", "--json", str(out),
         "--plot", str(tmp_path / "fig.png")]
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["settings"]["methods"] == ["router", "reap", "frequency"]
    half = doc["summary"]["0.5"]["methods"]
    assert set(half) == {"router", "reap", "frequency"}
    for method, cells in half.items():
        for name in ("standard", "emo"):
            cell = cells[name]
            lo, hi = cell["ci95"]
            assert lo <= cell["relative"] <= hi
            assert ("minus_router" in cell) == (method != "router")
    # the router row of the table is the figure's router summary
    assert half["router"]["standard"]["relative"] == doc["summary"]["0.5"]["standard"]["relative"]
    # all experts kept: every method is the full model
    assert all(
        c["relative"] == 0 for cells in doc["summary"]["1"]["methods"].values() for c in cells.values()
    )
    # the same model twice: both columns agree, per method
    assert half["reap"]["standard"] == half["reap"]["emo"]
    domain = next(iter(doc["results"]["standard"].values()))
    assert set(domain["0.5"]["methods"]) == {"reap", "frequency"}
    assert "reap" in capsys.readouterr().out
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the methods drawn beside router


def test_unknown_method_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        subset_retention.main(["--models", "a", "b", "--methods", "router,magic"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--methods: unknown selection method 'magic'" in err and "reap" in err and err.count("\n") == 1


def test_quantized_retention_records_the_scheme_and_what_quantizing_costs(tmp_path, capsys):
    """``--quantize int4``: subsets chosen (wanda too: it reads float weights) and fine-tuned on the
    float32 model, measured on the int4 one against the int4 full model; the JSON names the scheme and
    holds the unquantized full model's losses beside it."""
    out = tmp_path / "retention.json"
    subset_retention.main(
        ["--models", "tiny:olmoe", "tiny:qwen2_moe", "--calib-docs", "1", "--eval-docs", "1", "--max-length", "16",
         "--fractions", "1,0.5", "--methods", "wanda", "--iters", "50", "--json", str(out), "--quantize", "int4",
         "--group-size", "32", "--finetune", "--ft-domains", "code", "--ft-docs", "2", "--ft-steps", "1",
         "--ft-batch", "2", "--ft-micro", "2", "--plot", str(tmp_path / "fig.png")]
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["settings"]["quantize"] == "int4" and doc["settings"]["group_size"] == 32
    quant = doc["quantization"]
    assert quant["scheme"] == "int4" and quant["group_size"] == 32 and quant["activations"] == "float32"
    assert all(s["scheme"] == "int4" and s["experts_modules"] > 0 for s in quant["models"].values())
    for name in ("standard", "emo"):
        cost = quant["full_model"][name]
        assert abs(cost["relative"]) < 0.05 and cost["ci95"][0] <= cost["relative"] <= cost["ci95"][1]
        # all experts kept: the quantized subset is the quantized full model
        assert quant["subsets_vs_unquantized"]["1"][name] == cost
        rows = doc["results"][name]
        assert any(r["nll_full"] != r["unquantized"]["nll_full"] for r in rows.values())  # it was quantized
        for row in rows.values():
            assert row["quantization"]["relative"] == pytest.approx(
                sum(row["nll_full"]) / sum(row["unquantized"]["nll_full"]) - 1, abs=1e-4
            )
            # relative to the int4 full model: all experts kept is that model
            assert row["1"]["relative"] == 0 and row["1"]["nll"] == row["nll_full"]
            assert np.isfinite(row["0.5"]["relative"]) and np.isfinite(
                row["0.5"]["methods"]["wanda"]["relative"]
            )
        assert np.isfinite(rows["code"]["0.5"]["finetuned"]["relative"])  # fine-tuned, then quantized
    assert doc["summary"]["0.5"]["finetuned"]["domains"] == ["code"]
    assert "int4 (group 32) full model vs unquantized" in capsys.readouterr().out


def test_bad_quantize_is_one_line_and_exit_2(capsys):
    for argv, message in ((["--quantize", "int3"], "quantize must be one of int8, int4"),
                          (["--quantize", "int4", "--group-size", "48"], "group size must be one of")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            subset_retention.main(["--models", "a", "b", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and err.count("\n") == 1
