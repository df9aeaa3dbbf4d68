"""Tokenizer training, round trip, special tokens, token counts and the shipped tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from moectl.data.sample import iter_documents, sample_corpus_dir
from moectl.data.tokenizer_train import BOS, EOS, PAD, count_tokens, default_tokenizer_dir, train_tokenizer

TEXTS = [
    ("prose", "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
              "must be in want of a wife. However little known the feelings or views of such a man may be."),
    ("code", "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
             "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\tfor i in range(10):\n\t\tprint(i)\n"),
    ("de", "Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist Verpflichtung "
           "aller staatlichen Gewalt. Grüße aus Köln — straße, Öl, Ärger."),
    ("fr", "Les paramètres obligatoires pour les options de forme longue le sont aussi pour les options "
           "de forme courte. « Déjà vu » ; où est l'hôtel ?"),
]
ROUND_TRIP = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nand CRLF\r\n",
    "ünïcödé, 中文, emoji 🙂, and math ∀x∈ℝ: x² ≥ 0",
    "def f(x):\n    return x ** 2  # comment",
    "unseen words: zyxwvut qqqq 1234567890",
]


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    lines = [json.dumps({"text": text * 3, "domain": dom, "source": dom, "licence": "CC0-1.0", "id": f"{dom}:{i}"})
             for i in range(8) for dom, text in TEXTS]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "validation.jsonl").write_text(lines[0] + "\n")
    (root / "test.jsonl").write_text(lines[1] + "\n")
    return root


@pytest.fixture(scope="module")
def trained(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tok")
    summary = train_tokenizer(tiny_corpus, vocab_size=600, out_dir=out, min_frequency=2)
    return out, summary


def test_trained_tokenizer_round_trips(trained: tuple[Path, dict]) -> None:
    out, summary = trained
    tok = AutoTokenizer.from_pretrained(str(out))
    assert 256 + 3 < len(tok) <= 600 and summary["vocab_size"] == len(tok)
    for text in ROUND_TRIP + [t for _, t in TEXTS]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    prose = TEXTS[0][1]
    assert len(tok.encode(prose, add_special_tokens=False)) < len(prose.encode()) / 2  # merges were learned


def test_special_tokens(trained: tuple[Path, dict]) -> None:
    out, summary = trained
    tok = AutoTokenizer.from_pretrained(str(out))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    ids = [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]
    assert ids == [0, 1, 2]
    assert tok.convert_ids_to_tokens(ids) == [BOS, EOS, PAD]
    assert tok.encode(f"{BOS}hi{EOS}", add_special_tokens=False)[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False) == tok.encode("hi")  # encode adds nothing by itself
    assert tok.decode([tok.eos_token_id], skip_special_tokens=True) == ""
    assert summary["characters_per_domain"] == {dom: 8 * 3 * len(text) for dom, text in sorted(TEXTS)}


def test_count_tokens(trained: tuple[Path, dict], tiny_corpus: Path) -> None:
    out, _ = trained
    tok = AutoTokenizer.from_pretrained(str(out))
    counts = count_tokens(tiny_corpus, out)
    assert set(counts) == {dom for dom, _ in TEXTS}
    expected = sum(len(tok.encode(t * 3, add_special_tokens=False)) for d, t in TEXTS if d == "code") * 8
    assert counts["code"]["train"] == {"documents": 8, "characters": 8 * 3 * len(TEXTS[1][1]), "tokens": expected}
    assert counts["prose"]["validation"]["documents"] == 1 and counts["code"]["test"]["documents"] == 1


def test_bad_inputs(tiny_corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 512"):
        train_tokenizer(tiny_corpus, vocab_size=100, out_dir=tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train_tokenizer(tmp_path / "missing", vocab_size=1000, out_dir=tmp_path / "t")
    with pytest.raises(ValueError, match="no training documents"):
        train_tokenizer(tiny_corpus, vocab_size=1000, out_dir=tmp_path / "t", domains=["nope"])


def test_shipped_tokenizer_loads_and_round_trips_the_sample() -> None:
    tok = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    assert len(tok) in (4096, 8192)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    seen: set[str] = set()
    for doc in iter_documents(sample_corpus_dir(), "validation"):
        if doc["domain"] in seen:
            continue
        seen.add(doc["domain"])
        ids = tok.encode(doc["text"], add_special_tokens=False)
        assert tok.decode(ids) == doc["text"]
        assert len(ids) < len(doc["text"]) / 2  # at least 2 characters per token on every domain
    assert len(seen) >= 8
