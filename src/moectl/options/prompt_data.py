"""Prompts and held-out texts for options training and evaluation.

A path is a JSONL file (``prompt`` or ``text`` per line, optional ``domain``/``category``) or a
moectl corpus folder (documents of one split, grouped by their ``domain``); None is the sample
corpus shipped with moectl. From corpus documents a prompt is the start of the document.
"""

from __future__ import annotations

from pathlib import Path

from moectl.data.domains import texts_by_domain as _texts_by_domain


def texts_by_domain(
    path: str | Path | None, split: str = "test", max_docs: int | None = None
) -> dict[str, list[str]]:
    """Texts grouped by domain (JSONL lines without a domain field: one group ``all``)."""
    return _texts_by_domain(path, split, max_docs, default_domain="all", fields=("prompt", "text"))


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
