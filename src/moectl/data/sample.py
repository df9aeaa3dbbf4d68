"""Read corpora, and the small sample corpus shipped inside the package.

A corpus folder holds ``train``, ``validation`` and ``test`` splits as ``{split}.jsonl`` or
``{split}.jsonl.gz`` (one JSON document per line with ``text``, ``domain``, ``source``,
``licence`` and ``id``). :func:`subsample_corpus` makes the shipped sample from a full build by a
deterministic rule: per domain and split, whole documents in the order of a hash of their id,
skipping very long ones, until a character budget is reached.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from moectl.data.build import CHARS_PER_TOKEN
from moectl.data.jsonl import iter_jsonl_rows
from moectl.data.split import SPLITS, unit_hash
from moectl.errors import ConfigError, MoectlFileError
from moectl.io.atomic import atomic_dir

__all__ = [
    "corpus_files",
    "iter_documents",
    "load_sample_corpus",
    "sample_corpus_dir",
    "subsample_corpus",
]

SAMPLE_BUDGET: dict[str, int] = {"train": 1_400_000, "validation": 100_000, "test": 100_000}
"""Default characters per domain and split in the shipped sample."""


def sample_corpus_dir() -> Path:
    """Folder of the sample corpus shipped with moectl (``moectl/data/sample``)."""
    return Path(str(resources.files("moectl.data") / "sample"))


def corpus_files(path: str | Path, split: str) -> list[Path]:
    """The files of ``split`` in a corpus folder (``.jsonl`` preferred over ``.jsonl.gz``), or ``[path]``."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise MoectlFileError(f"corpus {path} does not exist")
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    for name in (f"{split}.jsonl", f"{split}.jsonl.gz"):
        if (path / name).is_file():
            return [path / name]
    shards = sorted(path.glob(f"*/{split}.jsonl")) + sorted(path.glob(f"*/{split}.jsonl.gz"))
    if shards:
        return shards
    raise MoectlFileError(f"corpus {path} has no {split}.jsonl or {split}.jsonl.gz")


def iter_documents(
    path_or_dir: str | Path, split: str = "train", domains: Iterable[str] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the documents of one split of a corpus folder (or of one JSONL/JSONL.gz file).

    ``domains`` keeps only documents of those domains.
    """
    wanted = set(domains) if domains is not None else None
    for file in corpus_files(path_or_dir, split):
        for _, doc in iter_jsonl_rows(file):
            if wanted is None or doc["domain"] in wanted:
                yield doc


def load_sample_corpus(split: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """The shipped sample corpus as ``{split: [document, ...]}`` (one split if ``split`` is given)."""
    splits = SPLITS if split is None else (split,)
    return {s: list(iter_documents(sample_corpus_dir(), s)) for s in splits}


def subsample_corpus(
    corpus_dir: str | Path,
    out_dir: str | Path,
    budget: dict[str, int] | None = None,
    max_doc_chars: int = 40_000,
) -> dict[str, Any]:
    """Write a small deterministic sample of a built corpus as gzip JSONL, and its ``stats.json``.

    For each domain and split, documents no longer than ``max_doc_chars`` are taken whole in the
    order of a hash of their id until ``budget[split]`` characters are reached (the document that
    crosses the budget is kept). The result depends only on the corpus content, not its order.
    """
    budget = budget or SAMPLE_BUDGET
    out = Path(out_dir)
    stats: dict[str, Any] = {"format": "moectl-corpus/1", "sample_of": str(corpus_dir), "budget": budget,
                             "max_doc_chars": max_doc_chars, "domains": {}, "total": {}}
    with atomic_dir(out, keep_others=True) as tmp:  # the old sample or the new, never a mix
        for split in SPLITS:
            candidates: dict[str, list[tuple[float, dict[str, Any]]]] = {}
            for doc in iter_documents(corpus_dir, split):
                if len(doc["text"]) <= max_doc_chars:
                    candidates.setdefault(doc["domain"], []).append((unit_hash(doc["id"], "sample"), doc))
            chosen: list[dict[str, Any]] = []
            for domain in sorted(candidates):
                taken = 0
                for _, doc in sorted(candidates[domain], key=lambda c: c[0]):
                    if taken >= budget[split]:
                        break
                    chosen.append(doc)
                    taken += len(doc["text"])
                    d = stats["domains"].setdefault(domain, {}).setdefault(
                        split, {"documents": 0, "characters": 0, "approx_tokens": 0})
                    d["documents"] += 1
                    d["characters"] += len(doc["text"])
                    d["approx_tokens"] += -(-len(doc["text"]) // CHARS_PER_TOKEN)
            chosen.sort(key=lambda d: d["id"])
            with gzip.GzipFile(tmp / f"{split}.jsonl.gz", "wb", compresslevel=9, mtime=0) as raw:
                for doc in chosen:
                    raw.write((json.dumps(doc, ensure_ascii=False) + "\n").encode())
            stats["total"][split] = {"documents": len(chosen), "characters": sum(len(d["text"]) for d in chosen)}
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return stats
