"""``eval --limit N`` with ``--perplexity``: N documents per domain, as ``options eval --max-docs``."""

from __future__ import annotations

import json
from collections import Counter

from typer.testing import CliRunner

from moectl.cli import app
from moectl.data.domains import sample_corpus_dir, texts_by_domain
from moectl.eval.perplexity import read_corpus


def test_limit_takes_the_first_n_documents_of_every_domain():
    """The sample's test split is grouped by domain: the first 18 documents in file order were 13
    Spanish and 5 prose ones (2 of 9 domains)."""
    docs = read_corpus(sample_corpus_dir(), "test", limit=2)
    expected = texts_by_domain(sample_corpus_dir(), "test", 2)  # what options eval --max-docs 2 reads
    assert Counter(d.domain for d in docs) == {domain: 2 for domain in expected}
    assert len(expected) == 9
    for domain, texts in expected.items():
        assert [d.text for d in docs if d.domain == domain] == texts
    assert len(read_corpus(sample_corpus_dir(), "test")) == 411  # no limit: every document


def test_limit_without_domains_counts_documents(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5)))
    assert [d.text for d in read_corpus(path, limit=3)] == ["document 0", "document 1", "document 2"]


def test_eval_perplexity_limit_covers_every_domain(tmp_path):
    out = tmp_path / "r.json"
    args = ["eval", "tiny:olmoe", "--perplexity", str(sample_corpus_dir()), "--limit", "1", "--by-domain"]
    result = CliRunner().invoke(app, [*args, "--max-length", "32", "--json", str(out)])
    assert result.exit_code == 0, result.output
    tasks = json.loads(out.read_text())["tasks"]
    assert {t for t in tasks if t != "perplexity/all"} == {f"perplexity/{d}" for d in texts_by_domain(sample_corpus_dir(), "test")}
