"""Texts grouped by domain, from whatever a user points a verb at.

One reader for every verb and benchmark that needs ``{domain: [texts]}``:

- ``None``: the sample corpus shipped with moectl (its documents of ``split``);
- a moectl corpus folder (it holds ``SPLIT.jsonl[.gz]``): that split's documents by ``domain``;
- any other folder: its ``DOMAIN.jsonl`` files, one domain per file (the file's stem);
- a JSONL file: its lines by their ``domain`` (or ``category``) field, lines without one under
  ``default_domain`` (default: the file's stem).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

from moectl.data.jsonl import iter_jsonl_rows
from moectl.data.sample import iter_documents, sample_corpus_dir
from moectl.errors import ConfigError, FileFormatError, MoectlFileError


def read_texts(path: Path, limit: int | None = None) -> list[str]:
    """The ``text`` field of every JSONL line, at most ``limit``; blank lines and empty texts skipped."""
    rows = iter_jsonl_rows(path, "text")
    texts = list(islice((row["text"] for _, row in rows if row["text"].strip()), limit))
    if not texts:
        raise FileFormatError(f"{path}: no documents")
    return texts


def is_corpus(path: Path, split: str = "validation") -> bool:
    """Whether ``path`` is a moectl corpus folder holding ``split``."""
    return path.is_dir() and any((path / f"{split}.{ext}").exists() for ext in ("jsonl", "jsonl.gz"))


def corpus_texts_by_domain(
    path: str | Path, max_docs: int | None = None, split: str = "validation"
) -> dict[str, list[str]]:
    """Documents of one split of a moectl corpus folder, grouped by their ``domain`` field."""
    texts: dict[str, list[str]] = {}
    for doc in iter_documents(path, split):
        bucket = texts.setdefault(doc.get("domain", "all"), [])
        if max_docs is None or len(bucket) < max_docs:
            bucket.append(doc["text"])
    return dict(sorted(texts.items()))


def _file_rows(path: Path, fields: Sequence[str]) -> Iterator[tuple[str | None, str]]:
    """(domain or None, text) per line: the text is the first of ``fields`` a line has; blank
    texts skipped."""
    for _, row in iter_jsonl_rows(path, tuple(fields)):
        text = next(row[name] for name in fields if name in row)
        if text.strip():
            yield row.get("domain", row.get("category")), text


def _wanted(min_domains: int, split: str) -> str:
    needed = "two DOMAIN.jsonl files" if min_domains > 1 else "one DOMAIN.jsonl file"
    return (
        f"needs a directory with at least {needed}, or a corpus folder ({split}.jsonl with a 'domain' "
        "field)" + (", or one JSONL file" if min_domains <= 1 else "")
    )


def texts_by_domain(
    path: str | Path | None,
    split: str = "validation",
    max_docs: int | None = None,
    *,
    min_domains: int = 1,
    default_domain: str | None = None,
    fields: Sequence[str] = ("text",),
) -> dict[str, list[str]]:
    """``{domain: texts}`` (at most ``max_docs`` per domain) from ``path`` (see the module docstring).

    ``fields``: the JSONL field holding the text, first present wins (``("prompt", "text")`` for
    prompts). Raises ``FileNotFoundError`` for a missing path, ``ValueError`` for fewer than
    ``min_domains`` domains or no texts.
    """
    path = sample_corpus_dir() if path is None else Path(path)
    if not path.exists():
        raise MoectlFileError(f"{path} does not exist: {_wanted(min_domains, split)}")
    groups: dict[str, list[str]] = {}
    if path.is_file():
        for domain, text in _file_rows(path, fields):
            bucket = groups.setdefault(str(domain or default_domain or path.stem), [])
            if max_docs is None or len(bucket) < max_docs:
                bucket.append(text)
    elif is_corpus(path, split):
        groups = corpus_texts_by_domain(path, max_docs, split)
    else:
        files = sorted(path.glob("*.jsonl"))
        if len(files) < min_domains or not files:
            raise ConfigError(f"{path}: {_wanted(min_domains, split)}")
        groups = {f.stem: read_texts(f, max_docs) for f in files}
    if not groups:
        raise FileFormatError(f"{path} holds no texts (split {split!r})")
    if len(groups) < min_domains:
        raise ConfigError(f"{path}: {len(groups)} domain(s), at least {min_domains} needed")
    return dict(sorted(groups.items()))
