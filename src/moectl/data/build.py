"""Build the multi-domain corpus: fetch, extract, decode, strip, de-duplicate, split, write JSONL.

``build_corpus(out_dir, cache_dir)`` writes::

    out_dir/train.jsonl  validation.jsonl  test.jsonl   one JSON object per document:
                                                        {"text", "domain", "source", "licence", "id"}
    out_dir/stats.json                                  documents / characters / approx. tokens per
                                                        domain and split, and per source (licence,
                                                        package versions, what was dropped)

Documents are kept whole (a file, a man page, a book chapter, a GO term, a licence). Each source's
documents are also cached, after stripping, as ``cache_dir/documents/SOURCE-KEY.jsonl.gz``, so a
rebuild (other domains, another split) does not decode them again. Approximate tokens are
characters / 4; ``moectl tokenizer train`` reports real token counts.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import importlib.util
import json
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moectl.data.corpus_fetch import fetch_source
from moectl.data.decoders import DECODERS
from moectl.data.markup import normalise_whitespace, strip
from moectl.data.sources import SOURCES, Source, select_sources
from moectl.data.split import DEFAULT_FRACTIONS, SPLITS, content_key, split_of, unit_hash
from moectl.errors import ConfigError
from moectl.extras import extra_of
from moectl.io.atomic import atomic_dir, atomic_path, write_text_atomic

__all__ = ["CHARS_PER_TOKEN", "PIPELINE_VERSION", "build_corpus", "source_documents"]

PIPELINE_VERSION = 1
"""Bump when decoding or stripping changes, to invalidate cached documents."""

CHARS_PER_TOKEN = 4
"""Characters per token for the approximate token counts (before a tokenizer exists)."""


def _matching_files(source: Source, roots: list[Path]) -> dict[str, Path]:
    """Files of ``source`` (relative POSIX path -> absolute path), first root wins on clashes."""
    files: dict[str, Path] = {}
    for root in roots:
        for pattern in source.include:
            for path in root.glob(pattern):
                if path.is_symlink() or not path.is_file():
                    continue
                rel = path.relative_to(root).as_posix()
                if rel in files or any(fnmatch.fnmatch(rel, ex) for ex in source.exclude):
                    continue
                files[rel] = path
    return files


def _clean(text: str, source: Source) -> tuple[str | None, str]:
    """Strip markup and normalise; return ``(text, "")`` or ``(None, reason)`` for a dropped document."""
    options = {"skip_classes": source.html_skip} if source.markup == "html" else {}
    text = normalise_whitespace(strip(text, source.markup, **options))
    if len(text) < source.min_chars:
        return None, "dropped_short"
    if len(text) > source.max_doc_chars:
        return None, "dropped_long"
    if source.max_line_chars is not None and max(map(len, text.split("\n"))) > source.max_line_chars:
        return None, "dropped_long"
    return text, ""


def source_documents(
    source: Source, roots: list[Path], max_docs: int | None = None, counts: dict[str, int] | None = None,
    on_file: Any = None,
) -> Iterator[tuple[str, str]]:
    """Yield ``(id, text)`` of the cleaned documents of ``source`` in a fixed pseudo-random order.

    Files are visited in the order of a hash of their id, so ``max_docs`` and ``source.max_chars``
    keep an order-independent subset; units inside one file are ordered the same way. ``counts``
    (if given) receives ``files``, ``dropped_short`` and ``dropped_long``; ``on_file(n_files)``
    is called once with the number of files and then after each file (for progress bars).
    """
    counts = counts if counts is not None else {}
    decode = DECODERS[source.decoder]
    files = _matching_files(source, roots)
    order = sorted(files, key=lambda rel: unit_hash(f"{source.name}:{rel}", "order"))
    counts["files"] = len(order)
    if on_file is not None:
        on_file(len(order))
    taken_docs = taken_chars = 0
    for rel in order:
        units = sorted(decode(files[rel], roots), key=lambda u: unit_hash(f"{source.name}:{rel}#{u[0]}", "order"))
        for unit, raw in units:
            text, reason = _clean(raw, source)
            if text is None:
                counts[reason] = counts.get(reason, 0) + 1
                continue
            yield f"{source.name}:{rel}" + (f"#{unit}" if unit else ""), text
            taken_docs += 1
            taken_chars += len(text)
            if (max_docs is not None and taken_docs >= max_docs) or (
                source.max_chars is not None and taken_chars >= source.max_chars
            ):
                counts["capped"] = 1
                if on_file is not None:
                    on_file(None)
                return
        if on_file is not None:
            on_file(None)


def _cache_key(source: Source, max_docs: int | None) -> str:
    spec = json.dumps([asdict(source), max_docs, PIPELINE_VERSION], sort_keys=True, default=str)
    return hashlib.sha1(spec.encode()).hexdigest()[:12]


def _cached_documents(
    source: Source, roots: list[Path], cache_dir: Path, max_docs: int | None, counts: dict[str, int],
    on_file: Any,
) -> Iterator[tuple[str, str]]:
    """:func:`source_documents`, read from / written to the per-source document cache."""
    folder = cache_dir / "documents"
    path = folder / f"{source.name}-{_cache_key(source, max_docs)}.jsonl.gz"
    meta_path = path.with_suffix(".meta.json")
    if path.exists() and meta_path.exists():
        counts.update(json.loads(meta_path.read_text()))
        if on_file is not None:
            on_file(1)
            on_file(None)
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                yield rec["id"], rec["text"]
        return
    with atomic_path(path) as tmp, gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as fh:
        for doc_id, text in source_documents(source, roots, max_docs, counts, on_file):
            fh.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
            yield doc_id, text
    write_text_atomic(meta_path, json.dumps(counts))  # after the documents: read only beside them


def _empty_counter() -> dict[str, int]:
    return {"documents": 0, "characters": 0, "approx_tokens": 0}


def _add(counter: dict[str, int], chars: int) -> None:
    counter["documents"] += 1
    counter["characters"] += chars
    counter["approx_tokens"] += -(-chars // CHARS_PER_TOKEN)


def build_corpus(
    out_dir: str | Path,
    cache_dir: str | Path,
    domains: Iterable[str] | None = None,
    max_docs_per_source: int | None = None,
    progress: bool = True,
    sources: tuple[Source, ...] = SOURCES,
    fractions: tuple[float, float, float] = DEFAULT_FRACTIONS,
) -> dict[str, Any]:
    """Build the corpus into ``out_dir`` (see the module docstring) and return its statistics.

    Args:
        out_dir: folder for ``{train,validation,test}.jsonl`` and ``stats.json`` (created).
        cache_dir: folder for downloaded packages, unpacked trees and cleaned documents.
        domains: domains to build (default: every domain of ``sources``); unknown names raise
            ``ValueError`` naming the allowed ones.
        max_docs_per_source: take at most this many documents from each source (quick builds).
        progress: show a rich progress bar on stderr.
        sources: the source table (default :data:`moectl.data.sources.SOURCES`; tests pass their own).
        fractions: train/validation/test fractions of the id-hash split.
    """
    out = Path(out_dir)
    cache = Path(cache_dir)
    chosen = select_sources(list(domains) if domains is not None else None, sources)
    if max_docs_per_source is not None and max_docs_per_source < 1:
        raise ConfigError("max_docs_per_source must be at least 1")
    seen: set[str] = set()
    domain_stats: dict[str, dict[str, Any]] = {}
    source_stats: dict[str, dict[str, Any]] = {}
    console = Console(stderr=True)
    with ExitStack() as stack:
        # the splits and stats.json appear together, complete (the old corpus until then)
        tmp_out = stack.enter_context(atomic_dir(out, keep_others=True))
        tmp_paths = {s: tmp_out / f"{s}.jsonl" for s in SPLITS}
        writers = {s: stack.enter_context(open(p, "w", encoding="utf-8")) for s, p in tmp_paths.items()}
        bar = stack.enter_context(Progress(
            TextColumn("[bold]{task.fields[domain]:>6}[/] {task.description:<26}"), BarColumn(),
            MofNCompleteColumn(), TextColumn("{task.fields[chars]:>7.1f}M chars"), TimeElapsedColumn(),
            console=console, disable=not progress,
        ))
        for source in chosen:
            missing = [m for m in source.requires if importlib.util.find_spec(m) is None]
            if missing:
                install = " ".join(sorted({f"'moectl[{extra_of(m)}]'" if extra_of(m) else m for m in missing}))
                console.print(f"[yellow]warning:[/] skipping source {source.name}: it needs the Python "
                              f"package(s) {', '.join(missing)} (pip install {escape(install)})")
                source_stats[source.name] = {"domain": source.domain, "skipped": f"missing {', '.join(missing)}"}
                continue
            task = bar.add_task(source.name, total=None, domain=source.domain, chars=0.0)

            def on_file(n: int | None, task: Any = task) -> None:
                if n is None:
                    bar.advance(task)
                else:
                    bar.update(task, total=n)

            roots_versions = fetch_source(source, cache)
            roots = [r for r, _ in roots_versions]
            counts: dict[str, int] = {}
            sstat = {"domain": source.domain, "kind": source.kind, "packages": list(source.packages),
                     "versions": [v for _, v in roots_versions], "licence": source.licence, "note": source.note,
                     **_empty_counter(), "dropped_duplicate": 0}
            dstat = domain_stats.setdefault(source.domain, {**_empty_counter(),
                                                            "splits": {s: _empty_counter() for s in SPLITS}})
            for doc_id, text in _cached_documents(source, roots, cache, max_docs_per_source, counts, on_file):
                key = content_key(text)
                if key in seen:
                    sstat["dropped_duplicate"] += 1
                    continue
                seen.add(key)
                split = split_of(doc_id, fractions)
                record = {"text": text, "domain": source.domain, "source": source.name,
                          "licence": source.licence, "id": doc_id}
                writers[split].write(json.dumps(record, ensure_ascii=False) + "\n")
                _add(sstat, len(text))
                _add(dstat, len(text))
                _add(dstat["splits"][split], len(text))
                bar.update(task, chars=sstat["characters"] / 1e6)
            sstat.update({k: counts.get(k, 0) for k in ("files", "dropped_short", "dropped_long")})
            sstat["capped"] = bool(counts.get("capped"))
            source_stats[source.name] = sstat
        total = _empty_counter()
        for d in domain_stats.values():
            for k in total:
                total[k] += d[k]
        stats: dict[str, Any] = {
            "format": "moectl-corpus/1",
            "fractions": dict(zip(SPLITS, fractions, strict=True)),
            "token_estimate": f"approx_tokens = ceil(characters / {CHARS_PER_TOKEN}) per document",
            "max_docs_per_source": max_docs_per_source,
            "total": total,
            "domains": domain_stats,
            "sources": source_stats,
        }
        (tmp_out / "stats.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return stats
