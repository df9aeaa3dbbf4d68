"""`moectl corpus …` and `moectl tokenizer …` Typer apps, driven with CliRunner on fixture sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moectl.cli import corpus as cli
from moectl.cli.corpus import corpus_app
from moectl.cli.tokenizer import tokenizer_app
from moectl.data.sources import Source

runner = CliRunner()
TEXT = "A paragraph long enough to be kept as a document by the corpus builder, about topic "


def flat(output: str) -> str:
    """CLI output with rich's panel borders and line wrapping removed."""
    return " ".join(output.replace("│", " ").split())


@pytest.fixture
def fixture_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Replace the real source table by two local HTML sources in domains alpha and beta."""
    sources = []
    for domain, n in (("alpha", 30), ("beta", 5)):
        folder = tmp_path / "src" / domain
        folder.mkdir(parents=True)
        for i in range(n):
            (folder / f"{i}.html").write_text(f"<h1>{domain} {i}</h1><p>{TEXT * 3}{domain} {i}.</p>")
        sources.append(Source(name=f"{domain}-pages", domain=domain, kind="local", packages=(str(folder),),
                              include=("*.html",), markup="html", licence="CC0-1.0"))
    monkeypatch.setattr(cli, "SOURCES", tuple(sources))
    return tmp_path


def test_corpus_build_writes_table_and_json(fixture_sources: Path) -> None:
    tmp = fixture_sources
    result = runner.invoke(corpus_app, ["build", "--out", str(tmp / "corpus"), "--cache", str(tmp / "cache"),
                                        "--domains", "alpha", "--json", str(tmp / "stats.json"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "alpha" in result.output and "beta" not in result.output and "total" in result.output
    stats = json.loads((tmp / "stats.json").read_text())
    assert set(stats["domains"]) == {"alpha"} and stats["domains"]["alpha"]["documents"] == 30
    assert (tmp / "corpus" / "train.jsonl").exists() and (tmp / "corpus" / "stats.json").exists()


def test_corpus_build_rejects_unknown_domain(fixture_sources: Path) -> None:
    result = runner.invoke(corpus_app, ["build", "--out", str(fixture_sources / "c"), "--domains", "alpha,nope"])
    assert result.exit_code == 2
    assert "nope" in flat(result.output) and "allowed: alpha, beta" in flat(result.output)


def test_corpus_sources_lists_the_table(tmp_path: Path) -> None:
    result = runner.invoke(corpus_app, ["sources", "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "s.json").read_text())["sources"]
    assert {r["domain"] for r in rows} >= {"code", "docs", "prose", "math", "legal", "bio"}
    assert all(r["licence"] for r in rows)


def test_tokenizer_train_and_errors(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [{"text": f"Sentence number {i} about tokenizers and corpora. " * 5, "domain": "ab"[i % 2],
             "source": "s", "licence": "l", "id": f"s:{i}"} for i in range(40)]
    (corpus / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (corpus / "validation.jsonl").write_text(json.dumps(docs[0]) + "\n")
    (corpus / "test.jsonl").write_text(json.dumps(docs[1]) + "\n")
    out = tmp_path / "tok"
    result = runner.invoke(tokenizer_app, ["train", str(corpus), "--vocab", "512", "--out", str(out),
                                           "--json", str(tmp_path / "t.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "t.json").read_text())
    assert (out / "tokenizer.json").exists() and summary["out_dir"] == str(out)
    assert summary["tokens"]["a"]["train"]["documents"] == 20 and summary["tokens"]["a"]["train"]["tokens"] > 0

    missing = runner.invoke(tokenizer_app, ["train", str(tmp_path / "nope"), "--out", str(out)])
    assert missing.exit_code == 2 and "does not exist" in flat(missing.output)
    small = runner.invoke(tokenizer_app, ["train", str(corpus), "--vocab", "100", "--out", str(out)])
    assert small.exit_code == 2 and "at least 512" in flat(small.output)
