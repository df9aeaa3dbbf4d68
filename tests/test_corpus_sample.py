"""The sample corpus shipped inside the package, and the corpus readers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from moectl.data.sample import (
    corpus_files,
    iter_documents,
    load_sample_corpus,
    sample_corpus_dir,
    subsample_corpus,
)
from moectl.data.sources import DOMAINS, SOURCES
from moectl.data.split import SPLITS, content_key, split_of


@pytest.fixture(scope="module")
def sample() -> dict[str, list[dict]]:
    return load_sample_corpus()


def test_sample_has_every_domain_in_every_split(sample: dict[str, list[dict]]) -> None:
    assert set(sample) == set(SPLITS)
    for split in SPLITS:
        assert {d["domain"] for d in sample[split]} == set(DOMAINS), split


def test_sample_documents_are_well_formed(sample: dict[str, list[dict]]) -> None:
    licences = {s.name: s.licence for s in SOURCES}
    domains = {s.name: s.domain for s in SOURCES}
    all_docs = [d for split in SPLITS for d in sample[split]]
    assert len({d["id"] for d in all_docs}) == len(all_docs)
    assert len({content_key(d["text"]) for d in all_docs}) == len(all_docs)
    for split in SPLITS:
        for d in sample[split]:
            assert set(d) == {"text", "domain", "source", "licence", "id"}
            assert d["source"] in licences and d["licence"] == licences[d["source"]]
            assert d["domain"] == domains[d["source"]]
            assert split_of(d["id"]) == split  # the sample keeps the full corpus's split
            text = d["text"]
            assert len(text) >= 60 and text == text.rstrip() and not text.startswith("\n")


def test_sample_size_and_stats(sample: dict[str, list[dict]]) -> None:
    folder = sample_corpus_dir()
    total_bytes = sum(p.stat().st_size for p in folder.iterdir())
    assert total_bytes <= 5 * 1024 * 1024
    stats = json.loads((folder / "stats.json").read_text())
    for split in SPLITS:
        assert stats["total"][split]["documents"] == len(sample[split])
        assert stats["total"][split]["characters"] == sum(len(d["text"]) for d in sample[split])
    train_chars = {dom: sum(len(d["text"]) for d in sample["train"] if d["domain"] == dom) for dom in DOMAINS}
    assert min(train_chars.values()) > 500_000  # enough text per domain for a tiny model


def test_iter_documents_on_file_dir_and_domain_filter(tmp_path: Path) -> None:
    docs = [{"text": f"text {i}", "domain": "ab"[i % 2], "source": "s", "licence": "l", "id": f"s:{i}"}
            for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs) + "\n")
    with gzip.open(tmp_path / "test.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(docs[0]) + "\n")
    assert list(iter_documents(tmp_path, "train")) == docs
    assert list(iter_documents(tmp_path / "train.jsonl")) == docs
    assert [d["id"] for d in iter_documents(tmp_path, "train", domains=["b"])] == ["s:1", "s:3", "s:5"]
    assert list(iter_documents(tmp_path, "test")) == [docs[0]]
    with pytest.raises(FileNotFoundError, match=r"no validation\.jsonl"):
        corpus_files(tmp_path, "validation")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_documents(tmp_path / "missing", "train"))
    with pytest.raises(ValueError, match="unknown split"):
        corpus_files(tmp_path, "dev")


def test_subsample_is_deterministic_and_order_independent(tmp_path: Path) -> None:
    docs = [{"text": "word " * (50 + i), "domain": "ab"[i % 2], "source": "s", "licence": "l", "id": f"s:{i}"}
            for i in range(200)]
    for name, order in (("x", docs), ("y", docs[::-1])):
        (tmp_path / name).mkdir()
        for split in SPLITS:
            (tmp_path / name / f"{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in order))
    budget = {"train": 3000, "validation": 500, "test": 500}
    a = subsample_corpus(tmp_path / "x", tmp_path / "sx", budget=budget)
    b = subsample_corpus(tmp_path / "y", tmp_path / "sy", budget=budget)
    assert a["domains"] == b["domains"]
    for split in SPLITS:
        assert (tmp_path / "sx" / f"{split}.jsonl.gz").read_bytes() == (tmp_path / "sy" / f"{split}.jsonl.gz").read_bytes()
    for dom in "ab":
        chars = a["domains"][dom]["train"]["characters"]
        assert 3000 <= chars < 3000 + 2000  # stops at the first document crossing the budget
