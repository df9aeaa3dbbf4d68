"""benchmarks/residency_frontier.py end to end on a tiny model: JSON shape, residency-only KL = 0,
refused combinations listed, the frontier rule, and one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import residency_frontier


def test_frontier_benchmark_on_tiny_model(tmp_path):
    out, png = tmp_path / "frontier.json", tmp_path / "frontier.png"
    doc = residency_frontier.main(
        ["--model", "tiny:olmoe", "--budgets", "4,8", "--docs", "2", "--tokens", "8", "--controllers", "",
         "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert doc["budgets"] == [4, 8] and doc["num_experts"] == 8 and len(doc["domains"]) == 2
    rows = {(r["policy"], r["budget"]): r for r in doc["rows"]}
    # tiny:olmoe has 8 experts: option:8 fits only budget 8, option:16 none; the runtime refuses the rest
    assert ("option:8", 8) in rows and ("option:8", 4) not in rows
    assert {(s["policy"], s["budget"]) for s in doc["skipped"]} == {("option:8", 4), ("option:16", 4), ("option:16", 8)}
    assert all("too small" in s["reason"] for s in doc["skipped"])
    for budget in (4, 8):
        for policy in ("lru", "s3fifo", "arc", "reroute:0.01", "reroute:0.1"):
            row = rows[(policy, budget)]
            assert len(row["kl_docs"]) == len(row["mib_docs"]) == 2
            assert row["mib_per_token"] >= 0 and row["kl_ci95"] >= 0 and row["mib_ci95"] >= 0
        for policy in ("lru", "s3fifo", "arc"):  # the model's own routing: exactly the plain model
            assert rows[(policy, budget)]["kl_per_token"] == pytest.approx(0.0, abs=1e-6)
        assert doc["frontier"][str(budget)]  # at least one undominated point per budget
    assert rows[("option:8", 8)]["kl_per_token"] == pytest.approx(0.0, abs=1e-6)  # routing unchanged
    # option:8 of 8 experts loads them all at the warm-up's first token: nothing moves after it
    assert rows[("option:8", 8)]["mib_per_token"] == 0 and doc["frontier"]["8"] == ["option:8"]
    assert rows[("lru", 4)]["mib_per_token"] > 0


def test_mark_frontier_keeps_only_undominated_points_per_budget():
    def row(policy, budget, mib, kl):
        return {"policy": policy, "budget": budget, "mib_per_token": mib, "kl_per_token": kl}

    rows = [row("a", 8, 2.0, 0.0), row("b", 8, 1.0, 0.01), row("c", 8, 1.5, 0.02), row("d", 8, 2.0, 0.0),
            row("e", 16, 3.0, 0.5)]  # fmt: skip
    residency_frontier.mark_frontier(rows)
    assert [r["frontier"] for r in rows] == [True, True, False, True, True]  # equal points do not dominate


def test_bad_budgets_exit_2(capsys):
    with pytest.raises(SystemExit) as err:
        residency_frontier.main(["--model", "tiny:olmoe", "--budgets", "eight"])
    assert err.value.code == 2
    assert "--budgets" in capsys.readouterr().err
