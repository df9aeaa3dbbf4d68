"""``moectl roe`` verbs end to end on a tiny model: tables printed, JSON written."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from moectl.cli.roe import roe_app

app = typer.Typer()
app.add_typer(roe_app, name="roe")


@app.callback()
def _root() -> None:
    """Stands in for ``moectl`` until ``roe_app`` is mounted there."""


runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")


def _run(*args: str) -> str:
    result = runner.invoke(app, ["roe", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_generate_streams_and_writes_json(tmp_path):
    out = _run(
        "generate", "tiny:olmoe", "--k", "4", "--tau", "0.3", "--prompt", "Hello", "--max-new-tokens", "6",
        "--ignore-eos", "--json", str(tmp_path / "g.json"),
    )  # fmt: skip
    data = json.loads((tmp_path / "g.json").read_text())
    assert "RoE generate tiny:olmoe: K=4" in out
    assert data["config"]["K"] == 4 and data["config"]["tau"] == [0.3, 0.3, 0.3]
    assert len(data["outputs"]) == 1 and len(data["outputs"][0]["token_ids"]) == 6
    assert data["stats"]["sample_tokens"] == 24


def test_tune_then_score_with_the_profile(tmp_path):
    pytest.importorskip("optuna")
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps({"text": t}) for t in ["The quick brown fox.", "Hello there."]))
    profile = tmp_path / "profile.json"
    out = _run(
        "tune", "--tiny", "olmoe", "--k", "3", "--data", str(val), "--objective", "ppl", "--trials", "3",
        "--max-tau", "0.5", "--skip-layers", "1", "--out", str(profile), "--json", str(tmp_path / "t.json"),
    )  # fmt: skip
    assert "best validation perplexity" in out
    assert (
        profile.exists()
        and (tmp_path / "tau_heatmap.png").exists()
        and (tmp_path / "profile.optuna.db").exists()
    )
    out = _run(
        "score", "tiny:olmoe", "--temperatures", str(profile), "--data", str(val), "--adaptive", "auto",
        "--json", str(tmp_path / "s.json"),
    )  # fmt: skip
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["config"]["K"] == 3  # from the profile
    assert data["config"]["tau"] == json.loads(profile.read_text())["tau"]
    tuned = json.loads((tmp_path / "t.json").read_text())
    assert data["results"]["RoE"]["ppl"] == pytest.approx(tuned["value"], rel=1e-6)
    assert data["results"]["plain (K=1)"]["ppl"] == pytest.approx(tuned["baseline_tau0"], rel=1e-6)
    assert [row["samples_per_token"] for row in data["adaptive"][:2]] == [1.0, 3.0]
    assert "Adaptive K" in out


def test_bench_reports_ratios(tmp_path):
    _run(
        "bench", "tiny:olmoe", "--k", "1,4", "--variants", "clean,separate", "--prompt-tokens", "16",
        "--new-tokens", "3", "--repeats", "1", "--json", str(tmp_path / "b.json"),
    )  # fmt: skip
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    by = {(r["variant"], r["K"]): r for r in rows}
    assert by[("plain", None)]["latency_ratio"] == 1.0
    assert by[("clean", 4)]["kv_cache_bytes"] == by[("plain", None)]["kv_cache_bytes"]
    assert by[("separate", 4)]["kv_cache_bytes"] == 4 * by[("separate", 1)]["kv_cache_bytes"]
    assert by[("separate", 4)]["memory_ratio"] > by[("clean", 4)]["memory_ratio"]


def test_errors_are_reported_not_raised(tmp_path):
    result = runner.invoke(app, ["roe", "generate", "tiny:olmoe", "--k", "0", "--prompt", "x"])
    assert result.exit_code == 2 and "K (routing samples per token) must be an integer >= 1" in result.output
    result = runner.invoke(
        app, ["roe", "score", "tiny:olmoe", "--tau", "0.1,0.2", "--data", str(tmp_path / "no")]
    )
    assert result.exit_code == 2 and "does not exist" in result.output
