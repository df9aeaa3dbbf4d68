"""build_corpus on fixture folders with fake local sources (no network, no apt)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from moectl.data.build import build_corpus
from moectl.data.sample import iter_documents
from moectl.data.sources import DOMAINS, SOURCES, Source, select_sources
from moectl.data.split import SPLITS, content_key, split_of

LOREM = (
    "The quick brown fox jumps over the lazy dog while the committee deliberates at length about "
    "the merits of brevity, the cost of paper, and the weather in the northern provinces. "
)


def _html_page(i: int) -> str:
    return (
        f"<html><head><title>page {i}</title><script>tracking()</script></head><body>"
        f'<div class="navbar">Home | Next | Previous</div>'
        f"<h1>Topic number {i}</h1><p>{LOREM * 2}<b>item {i}</b></p></body></html>"
    )


def _man_page(i: int) -> str:
    return (
        f".TH TOOL{i} 1\n.SH NAME\ntool{i} \\- does thing {i}\n.SH DESCRIPTION\n"
        f"\\fBtool{i}\\fR processes input number {i}.\n{LOREM}\n.PP\n{LOREM}\n"
    )


def make_fixture(root: Path, reverse: bool = False) -> tuple[Source, ...]:
    """Two local sources in two domains; files written in forward or reverse order."""
    html_dir, man_dir = root / "web", root / "man"
    (html_dir / "sub").mkdir(parents=True)
    (man_dir / "man1").mkdir(parents=True)
    writes: list[tuple[Path, bytes]] = []
    for i in range(30):
        writes.append(((html_dir / "sub" if i % 2 else html_dir) / f"page{i:02d}.html", _html_page(i).encode()))
    writes.append((html_dir / "copy-of-page03.html", _html_page(3).encode()))  # exact duplicate content
    writes.append((html_dir / "tiny.html", b"<p>too short</p>"))
    writes.append((html_dir / "skip.txt", b"not matched by the include glob " * 20))
    for i in range(20):
        writes.append((man_dir / "man1" / f"tool{i:02d}.1.gz", gzip.compress(_man_page(i).encode())))
    for path, data in reversed(writes) if reverse else writes:
        path.write_bytes(data)
    return (
        Source(name="web", domain="alpha", kind="local", packages=(str(html_dir),), include=("**/*.html",),
               markup="html", html_skip=("navbar",), licence="CC0-1.0", min_chars=100),
        Source(name="man", domain="beta", kind="local", packages=(str(man_dir),), include=("man1/*.gz",),
               markup="roff", licence="GPL-3.0-or-later", min_chars=100),
    )


def read_split(out: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, dict, tuple[Source, ...]]:
    sources = make_fixture(tmp_path / "src")
    out = tmp_path / "out"
    stats = build_corpus(out, tmp_path / "cache", progress=False, sources=sources, fractions=(0.6, 0.2, 0.2))
    return out, stats, sources


def test_documents_are_labelled_and_markup_is_stripped(built: tuple[Path, dict, tuple[Source, ...]]) -> None:
    out, _, _ = built
    docs = [d for split in SPLITS for d in read_split(out, split)]
    assert {d["domain"] for d in docs} == {"alpha", "beta"}
    for d in docs:
        assert set(d) == {"text", "domain", "source", "licence", "id"}
        assert d["id"].startswith(f"{d['source']}:")
        assert {"web": "alpha", "man": "beta"}[d["source"]] == d["domain"]
        assert d["licence"] == {"web": "CC0-1.0", "man": "GPL-3.0-or-later"}[d["source"]]
        for markup in ("<", ">", "\\f", ".TH", ".SH", "tracking()", "Home | Next"):
            assert markup not in d["text"]
    by_id = {d["id"]: d["text"] for d in docs}
    assert by_id["web:page04.html"].startswith("Topic number 4\n\nThe quick brown fox")
    assert by_id["man:man1/tool07.1.gz"].startswith("NAME\n\ntool7 - does thing 7\n\nDESCRIPTION\n\ntool7 processes")


def test_dedup_tiny_docs_and_stats(built: tuple[Path, dict, tuple[Source, ...]]) -> None:
    out, stats, _ = built
    docs = [d for split in SPLITS for d in read_split(out, split)]
    ids = [d["id"] for d in docs]
    assert len(ids) == len(set(ids)) == 30 + 20  # 31 html pages with content, one a duplicate
    assert len({content_key(d["text"]) for d in docs}) == len(docs)
    # exactly one of the two identical pages survives: the one that comes first in the hash order
    assert ("web:sub/page03.html" in ids) != ("web:copy-of-page03.html" in ids)
    assert "web:tiny.html" not in ids and not any("skip.txt" in i for i in ids)
    web = stats["sources"]["web"]
    assert (web["files"], web["documents"], web["dropped_duplicate"], web["dropped_short"]) == (32, 30, 1, 1)
    on_disk = json.loads((out / "stats.json").read_text())
    assert on_disk == json.loads(json.dumps(stats))
    for domain in ("alpha", "beta"):
        d = stats["domains"][domain]
        per_split = [sum(1 for x in read_split(out, s) if x["domain"] == domain) for s in SPLITS]
        assert [d["splits"][s]["documents"] for s in SPLITS] == per_split
        assert d["documents"] == sum(per_split)
        chars = sum(len(x["text"]) for s in SPLITS for x in read_split(out, s) if x["domain"] == domain)
        assert d["characters"] == chars
        assert chars / 4 <= d["approx_tokens"] <= chars / 4 + d["documents"]
    assert stats["total"]["documents"] == 50


def test_split_follows_document_id(built: tuple[Path, dict, tuple[Source, ...]]) -> None:
    out, _, _ = built
    for split in SPLITS:
        docs = read_split(out, split)
        assert docs, f"split {split} is empty"
        assert all(split_of(d["id"], (0.6, 0.2, 0.2)) == split for d in docs)


def test_split_is_stable_across_runs_and_input_order(tmp_path: Path) -> None:
    runs = []
    for name, reverse in (("a", False), ("b", True), ("c", False)):
        sources = make_fixture(tmp_path / name / "src", reverse=reverse)
        out = tmp_path / name / "out"
        build_corpus(out, tmp_path / name / "cache", progress=False, sources=sources, fractions=(0.6, 0.2, 0.2))
        runs.append({s: [(d["id"], d["text"]) for d in read_split(out, s)] for s in SPLITS})
    assert runs[0] == runs[1] == runs[2]


def test_rebuild_uses_document_cache(tmp_path: Path) -> None:
    sources = make_fixture(tmp_path / "src")
    cache = tmp_path / "cache"
    first = build_corpus(tmp_path / "out1", cache, progress=False, sources=sources)
    cached = sorted((cache / "documents").glob("*.jsonl.gz"))
    assert [p.name.split("-")[0] for p in cached] == ["man", "web"]
    for page in (tmp_path / "src" / "web").rglob("*.html"):  # the cache, not the files, is read now
        page.unlink()
    second = build_corpus(tmp_path / "out2", cache, progress=False, sources=sources)
    assert first["domains"] == second["domains"]
    assert (tmp_path / "out1" / "train.jsonl").read_bytes() == (tmp_path / "out2" / "train.jsonl").read_bytes()


def test_domains_and_max_docs(tmp_path: Path) -> None:
    sources = make_fixture(tmp_path / "src")
    stats = build_corpus(tmp_path / "out", tmp_path / "cache", domains=["beta"], max_docs_per_source=5,
                         progress=False, sources=sources)
    assert set(stats["domains"]) == {"beta"}
    assert stats["sources"]["man"]["documents"] == 5 and stats["sources"]["man"]["capped"]
    docs = list(iter_documents(tmp_path / "out", "train")) + list(iter_documents(tmp_path / "out", "test"))
    assert all(d["domain"] == "beta" for d in docs)
    with pytest.raises(ValueError, match=r"unknown domain.*gamma.*allowed: alpha, beta"):
        build_corpus(tmp_path / "out", tmp_path / "cache", domains=["gamma"], progress=False, sources=sources)


def test_max_chars_cap_takes_a_hash_ordered_prefix(tmp_path: Path) -> None:
    web, _ = make_fixture(tmp_path / "src")
    capped = Source(**{**web.__dict__, "max_chars": 2000})
    stats = build_corpus(tmp_path / "out", tmp_path / "cache", progress=False, sources=(capped,))
    n = stats["sources"]["web"]["documents"]
    assert 1 <= n < 30 and stats["sources"]["web"]["capped"]
    assert stats["domains"]["alpha"]["characters"] - 2000 < 600  # stops right after crossing the cap


def test_split_fractions() -> None:
    ids = [f"src:file{i}" for i in range(20000)]
    counts = {s: sum(split_of(i) == s for i in ids) for s in SPLITS}
    assert abs(counts["train"] / 20000 - 0.98) < 0.005
    assert 100 < counts["validation"] < 300 and 100 < counts["test"] < 300
    assert split_of("src:file1") == split_of("src:file1")
    with pytest.raises(ValueError):
        split_of("x", (0.5, 0.5, 0.5))


def test_source_table_is_consistent() -> None:
    from moectl.data.decoders import DECODERS
    from moectl.data.markup import MARKUPS

    assert len(DOMAINS) >= 8
    assert len({s.name for s in SOURCES}) == len(SOURCES)
    for s in SOURCES:
        assert s.decoder in DECODERS and s.markup in MARKUPS and s.licence and s.include
    assert select_sources(["legal"]) == tuple(s for s in SOURCES if s.domain == "legal")
    with pytest.raises(ValueError, match="allowed: code, docs"):
        select_sources(["nope"])


def test_source_with_missing_python_dependency_is_skipped(tmp_path: Path) -> None:
    web, man = make_fixture(tmp_path / "src")
    needy = Source(**{**web.__dict__, "requires": ("moectl_no_such_module_xyz",)})
    stats = build_corpus(tmp_path / "out", tmp_path / "cache", progress=False, sources=(needy, man))
    assert stats["sources"]["web"] == {"domain": "alpha", "skipped": "missing moectl_no_such_module_xyz"}
    assert set(stats["domains"]) == {"beta"} and stats["sources"]["man"]["documents"] == 20
