"""Decoders: turn one source file into one or more documents, each kept whole.

A decoder is ``decode(path, roots) -> iterator of (unit, text)``: ``path`` is the matched file,
``roots`` the unpacked package folders of the source (for decoders that need a companion file),
``unit`` names the natural unit inside the file ("" for the whole file; a chapter, a term, a
section otherwise) and becomes the ``#unit`` suffix of the document id. Markup is *not* stripped
here (see :mod:`moectl.data.markup`), except for formats that only a decoder understands
(SWORD's OSIS, the Bible program's output).
"""

from __future__ import annotations

import gzip
import html
import re
import sqlite3
import struct
import subprocess
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from moectl.extras import optional_import

__all__ = ["DECODERS", "Decoder", "read_text"]

Decoder = Callable[[Path, Sequence[Path]], Iterator[tuple[str, str]]]


def read_text(path: Path) -> str:
    """Text of ``path`` (gzip-decompressed if it ends in ``.gz``): UTF-8, else Latin-1."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def decode_file(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """The whole file is one document."""
    yield "", read_text(path)


def decode_fortunes(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """A fortune file (quotations separated by ``%`` lines) as one document, one quotation per paragraph."""
    text = read_text(path)
    quotes = [q.strip("\n") for q in re.split(r"(?m)^%\s*$", text)]
    yield "", "\n\n".join(q for q in quotes if q.strip())


def decode_kjv_bible(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """The King James Bible via the ``bible`` program of ``bible-kjv``, one chapter per document.

    ``path`` is the ``bible`` executable; its data file ``bible.data`` comes from ``bible-kjv-text``
    (one of ``roots``). The program is run unpacked, without installing the package.
    """
    data_dirs = [str(d.parent) for r in roots for d in r.glob("usr/lib/bible.data")]
    if not data_dirs:
        raise FileNotFoundError("bible.data not found; the source needs the bible-kjv-text package")
    result = subprocess.run(
        [str(path), "-p", data_dirs[0], "-l", "100000", "gen1:1-rev22:21"],
        capture_output=True, check=True, stdin=subprocess.DEVNULL,
    )
    text = result.stdout.decode("utf-8", errors="replace")
    # pretty-printed output: a "Book N" line between blank lines, then "  v verse text" lines
    chapters = re.split(r"\n\n(?=\S[^\n]* \d+\n\n)", "\n" + text)
    for chapter in chapters:
        lines = [ln.strip() for ln in chapter.strip("\n").split("\n") if ln.strip()]
        if len(lines) < 2:
            continue
        title = lines[0]
        yield title.replace(" ", "-"), title + "\n\n" + "\n".join(lines[1:])


_OSIS_NOTE = re.compile(r"<note\b.*?</note>", re.S)
_OSIS_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.S)
_OSIS_PARA = re.compile(r"<div\b[^>]*type=\"x-p\"[^>]*/>|</?(?:p|lg)\b[^>]*>")
_OSIS_LINE = re.compile(r"<lb\b[^>]*/>|</l>")
_OSIS_CHAPTER = re.compile(r'<chapter\b[^>]*\bosisID="([^"]+)"[^>]*\bsID=[^>]*/>')


def _osis_text(xml: str) -> str:
    xml = _OSIS_NOTE.sub(" ", xml)  # a footnote often stands in for the space after it
    xml = _OSIS_TITLE.sub(lambda m: "\n\n" + m.group(1) + "\n\n", xml)
    xml = re.sub(r"(?<![\s(“‘])<transChange", " <transChange", xml)  # words supplied by translators
    xml = _OSIS_PARA.sub("\n\n", xml)
    xml = _OSIS_LINE.sub("\n", xml)
    xml = re.sub(r"<[^>]+>", "", xml)
    text = html.unescape(xml)
    text = re.sub(r"[ \t]+([,.;:!?’”)])", r"\1", text)
    return "\n".join(re.sub(r"[ \t]+", " ", ln).strip() for ln in text.split("\n"))


def decode_sword_ztext(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """A SWORD zText Bible module (``ot.bzz``/``nt.bzz`` + ``.bzs`` block index), one chapter per document.

    The ``.bzs`` index holds (offset, size, uncompressed size) triples of zlib blocks in ``.bzz``;
    concatenated, the blocks are the OSIS text of the testament in canonical order. Footnotes are
    dropped; chapters are split at OSIS ``<chapter osisID="Book.N" sID=…/>`` milestones.
    """
    index = path.with_suffix(".bzs").read_bytes()
    blob = path.read_bytes()
    parts = []
    for i in range(len(index) // 12):
        offset, size, _ = struct.unpack("<III", index[i * 12 : i * 12 + 12])
        if size:
            parts.append(zlib.decompress(blob[offset : offset + size]).decode("utf-8", errors="replace"))
    xml = "".join(parts)
    starts = list(_OSIS_CHAPTER.finditer(xml))
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(xml)
        body = _osis_text(xml[m.end() : end])
        book, _, chapter = m.group(1).partition(".")
        yield m.group(1), f"{book} {chapter}\n\n{body}"


def decode_r_lazyload_books(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """Novels stored as character vectors in an R lazy-load database (``Rdata.rdb`` + ``.rdx``).

    Each object is a vector of text lines; a novel is split into chapters at ``CHAPTER``/``Chapter``
    lines. Reading R serialisation needs the PyPI package ``rdata``.
    """
    rdata = optional_import("rdata", "the janeaustenr source")  # MissingExtraError: the corpus extra
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(path.with_suffix(".rdx").read_bytes())))
        blob = path.read_bytes()
        for name, (offset, length) in sorted(index["variables"].items()):
            chunk = blob[int(offset) : int(offset) + int(length)]
            lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(chunk[4:])))
            lines = [str(x) for x in lines]
            chapter: list[str] = []
            number = 0
            for line in [*lines, "CHAPTER END"]:
                if re.match(r"^\s*(CHAPTER|Chapter)\s+[\dIVXLC]+\b", line):
                    if number and any(s.strip() for s in chapter):
                        yield f"{name}-{number}", "\n".join(chapter)
                    number += 1
                    chapter = [line.strip()]
                elif number:
                    chapter.append(line)


_MM_HEADER = re.compile(r"(?m)^\$\(\n(?=(?:#\*#\*|=-=-|####)[^\n]*\n)")
_MM_PROOF = re.compile(r"\$=.*?\$\.", re.S)


def decode_metamath_sections(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """A Metamath database split at its part/chapter/section headers, compressed proofs elided.

    Proof bodies (``$= … $.``) are machine-generated and look like random letters, so they are
    replaced by ``$= … $.``; statements, hypotheses and the (often long) comments stay.
    """
    text = read_text(path)
    pieces = _MM_HEADER.split(text)
    for i, piece in enumerate(pieces):
        piece = _MM_PROOF.sub("$= ... $.", piece if i == 0 else "$(\n" + piece)
        yield f"s{i:05d}", piece


def decode_scancode_license(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """A ScanCode ``.LICENSE`` file: YAML front matter (dropped, but its ``name`` is kept as a title) + text."""
    text = read_text(path)
    name = ""
    if text.startswith("---"):
        head, _, body = text[3:].partition("\n---")
        m = re.search(r"(?m)^name:\s*(.+)$", head)
        name = m.group(1).strip().strip("'\"") if m else ""
        text = body.lstrip("-\n")
    if not text.strip():
        return
    yield "", (name + "\n\n" + text) if name else text


_GO_ONTOLOGY = {"BP": "biological process", "MF": "molecular function", "CC": "cellular component"}


def decode_go_sqlite(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """Gene Ontology terms from Bioconductor's ``GO.sqlite``: name, definition, synonyms and parents."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        names = dict(con.execute("SELECT _id, term FROM go_term"))
        synonyms: dict[int, list[str]] = {}
        for tid, syn in con.execute("SELECT _id, synonym FROM go_synonym WHERE synonym NOT LIKE 'GO:%'"):
            synonyms.setdefault(tid, []).append(syn)
        parents: dict[int, list[tuple[str, str]]] = {}
        for table in ("go_bp_parents", "go_mf_parents", "go_cc_parents"):
            for tid, pid, rel in con.execute(f"SELECT _id, _parent_id, relationship_type FROM {table}"):
                if pid in names:
                    parents.setdefault(tid, []).append((rel, names[pid]))
        rows = con.execute("SELECT _id, go_id, term, ontology, definition FROM go_term ORDER BY go_id").fetchall()
    finally:
        con.close()
    for tid, go_id, term, ontology, definition in rows:
        if not definition or go_id == "all":
            continue
        lines = [f"{term} ({_GO_ONTOLOGY.get(ontology, ontology)}, {go_id})", "", definition.strip()]
        if tid in synonyms:
            lines += ["", "Synonyms: " + "; ".join(sorted(set(synonyms[tid])))]
        by_rel: dict[str, list[str]] = {}
        for rel, parent in parents.get(tid, []):
            label = "is a" if rel == "isa" else rel.replace("_", " ")
            by_rel.setdefault(label[0].upper() + label[1:], []).append(parent)
        for rel in sorted(by_rel):
            lines.append(f"{rel}: " + "; ".join(sorted(set(by_rel[rel]))))
        yield go_id, "\n".join(lines)


def _obo_unquote(value: str) -> str:
    m = re.match(r'"((?:[^"\\]|\\.)*)"', value)
    return m.group(1).replace('\\"', '"') if m else value


def decode_obo_terms(path: Path, roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """Terms of an OBO ontology (e.g. the Human Phenotype Ontology): name, definition, comment, synonyms, parents."""
    text = read_text(path)
    for stanza in re.split(r"\n(?=\[)", text):
        if not stanza.startswith("[Term]"):
            continue
        tags: dict[str, list[str]] = {}
        for line in stanza.split("\n")[1:]:
            key, sep, value = line.partition(": ")
            if sep:
                tags.setdefault(key, []).append(value.strip())
        if "is_obsolete" in tags or "def" not in tags:
            continue
        term_id, name = tags["id"][0], tags.get("name", [""])[0]
        lines = [f"{name} ({term_id})", "", _obo_unquote(tags["def"][0])]
        if "comment" in tags:
            lines += ["", tags["comment"][0]]
        if "synonym" in tags:
            lines += ["", "Synonyms: " + "; ".join(_obo_unquote(s) for s in tags["synonym"])]
        parents = [p.split(" ! ", 1)[1] for p in tags.get("is_a", []) if " ! " in p]
        if parents:
            lines.append("Is a: " + "; ".join(parents))
        yield term_id, "\n".join(lines)


DECODERS: dict[str, Decoder] = {
    "file": decode_file,
    "fortunes": decode_fortunes,
    "kjv_bible": decode_kjv_bible,
    "sword_ztext": decode_sword_ztext,
    "r_lazyload_books": decode_r_lazyload_books,
    "metamath_sections": decode_metamath_sections,
    "scancode_license": decode_scancode_license,
    "go_sqlite": decode_go_sqlite,
    "obo_terms": decode_obo_terms,
}
"""Decoder names usable in :class:`moectl.data.sources.Source`."""
