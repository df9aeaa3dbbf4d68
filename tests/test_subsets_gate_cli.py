"""``moectl subset gate`` (EMO §6 capability gating) and ``moectl subset clusters`` (EMO §5.3)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moectl.cli.subset import subset_app
from moectl.subsets.files import save_subset

runner = CliRunner()
DOMAINS = {
    "math": ["1 + 1 = 2", "x^2 - 4 = 0 so x = 2", "3 * 3 = 9"],
    "prose": ["the cat sat on the mat", "once upon a time", "she walked home slowly"],
}


@pytest.fixture
def domains(tmp_path):
    folder = tmp_path / "domains"
    folder.mkdir()
    for name, texts in DOMAINS.items():
        (folder / f"{name}.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    return folder


def test_gate_reports_loss_with_and_without_the_subset(tmp_path, domains):
    keep = {0: [1, 3, 4, 6], 1: [0, 2, 5, 7], 2: [1, 2, 3, 4]}
    subset = save_subset(
        tmp_path / "math.subset.json", keep, calibration={"data": str(domains / "math.jsonl")}
    )
    out = tmp_path / "gate.json"
    args = ["gate", "tiny:olmoe", "--subset", str(subset), "--data", str(domains), "--json", str(out)]
    result = runner.invoke(subset_app, args)
    assert result.exit_code == 0, result.output
    assert "blocked" in result.output and "selectivity" in result.output
    report = json.loads(out.read_text())
    assert report["domain"] == "math" and set(report["domains"]) == {"math", "prose"}
    row = report["domains"]["prose"]
    assert row["increase"] == pytest.approx(row["blocked"] - row["full"])
    assert report["selectivity"] == pytest.approx(
        report["domains"]["math"]["increase"] - report["domains"]["prose"]["increase"]
    )

    too_many = save_subset(tmp_path / "big.subset.json", {i: list(range(7)) for i in keep})
    refused = runner.invoke(subset_app, [*args[:3], str(too_many), *args[4:]])
    assert refused.exit_code == 2 and "fewer than top-k" in refused.output
    missing = runner.invoke(subset_app, [*args[:5], str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "DOMAIN.jsonl" in missing.output


def test_clusters_writes_a_report(tmp_path, domains):
    out = tmp_path / "report"
    result = runner.invoke(
        subset_app,
        ["clusters", "tiny:qwen3_moe", "--data", str(domains), "--out", str(out), "--clusters", "3"],
    )
    assert result.exit_code == 0, result.output
    assert "purity" in result.output
    report = json.loads((out / "clusters.json").read_text())
    assert len(report["report"]) <= 3 and 0 < report["purity"] <= 1
    tokens = sum(len(t) for texts in DOMAINS.values() for t in texts)
    assert sum(row["tokens"] for row in report["report"]) == tokens  # byte tokens, all < 100 per document
    assert all(row["top_domain"] in DOMAINS for row in report["report"])

    single = runner.invoke(
        subset_app, ["clusters", "tiny:olmoe", "--data", str(domains / "math.jsonl"), "--out", str(out), "--clusters", "2"]
    )  # fmt: skip
    assert single.exit_code == 0, single.output
    bad = runner.invoke(
        subset_app, ["clusters", "tiny:olmoe", "--data", str(domains), "--out", str(out), "--variance", "2"]
    )
    assert bad.exit_code == 2 and "--variance" in bad.output
