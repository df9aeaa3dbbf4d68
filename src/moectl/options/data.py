"""Prompts and held-out texts for options training and evaluation.

A path is a JSONL file (``prompt`` or ``text`` per line, optional ``domain``/``category``) or a
moectl corpus folder (documents of one split, grouped by their ``domain``); None is the sample
corpus shipped with moectl. From corpus documents a prompt is the start of the document.
"""

from __future__ import annotations

from pathlib import Path

from moectl.data.jsonl import iter_jsonl_rows
from moectl.data.sample import iter_documents, sample_corpus_dir


def _is_corpus(path: Path) -> bool:
    return path.is_dir()


def texts_by_domain(
    path: str | Path | None, split: str = "test", max_docs: int | None = None
) -> dict[str, list[str]]:
    """Texts grouped by domain (JSONL without a domain field: one group ``all``)."""
    path = sample_corpus_dir() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (give a JSONL file or a moectl corpus folder)")
    groups: dict[str, list[str]] = {}
    if _is_corpus(path):
        rows = ({"text": d["text"], "domain": d.get("domain", "all")} for d in iter_documents(path, split))
    else:
        rows = _jsonl(path)
    for row in rows:
        bucket = groups.setdefault(str(row.get("domain", row.get("category", "all"))), [])
        if max_docs is None or len(bucket) < max_docs:
            bucket.append(row["text"])
    if not groups:
        raise ValueError(f"{path} holds no texts (split {split!r})")
    return dict(sorted(groups.items()))


def _jsonl(path: Path):
    """Rows with a non-empty ``prompt`` (else ``text``), that text as ``text``."""
    for _, row in iter_jsonl_rows(path, ("prompt", "text"), allow_empty=False):
        yield {**row, "text": row.get("prompt", row.get("text"))}


def read_prompts(
    path: str | Path | None, split: str = "train", limit: int | None = None, chars: int = 400
) -> list[str]:
    """Prompts: JSONL lines as they are; corpus documents cut to their first ``chars`` characters,
    interleaved across domains so every domain is represented."""
    groups = texts_by_domain(path, split, None if limit is None else limit)
    cut = not (path is not None and Path(path).is_file())
    columns = [[t[:chars] if cut else t for t in texts] for texts in groups.values()]
    prompts = [col[i] for i in range(max(len(c) for c in columns)) for col in columns if i < len(col)]
    return prompts[:limit] if limit is not None else prompts
