"""Decoders on small files written by the tests (formats of the real packages, in miniature)."""

from __future__ import annotations

import gzip
import sqlite3
import struct
import zlib
from pathlib import Path

from moectl.data.decoders import (
    decode_fortunes,
    decode_go_sqlite,
    decode_metamath_sections,
    decode_obo_terms,
    decode_scancode_license,
    decode_sword_ztext,
    read_text,
)


def test_read_text_gzip_and_latin1(tmp_path: Path) -> None:
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress("grüß".encode()))
    (tmp_path / "b.txt").write_bytes("café".encode("latin-1"))
    assert read_text(tmp_path / "a.txt.gz") == "grüß"
    assert read_text(tmp_path / "b.txt") == "café"


def test_fortunes(tmp_path: Path) -> None:
    f = tmp_path / "wisdom"
    f.write_text("First quote.\n\t-- Someone\n%\nSecond\nquote.\n%\n%\n")
    assert list(decode_fortunes(f, [])) == [("", "First quote.\n\t-- Someone\n\nSecond\nquote.")]


def test_scancode_license_front_matter(tmp_path: Path) -> None:
    f = tmp_path / "mit.LICENSE"
    f.write_text("---\nkey: mit\nname: MIT License\ncategory: Permissive\n---\n\nPermission is hereby granted.\n")
    assert list(decode_scancode_license(f, [])) == [("", "MIT License\n\nPermission is hereby granted.\n")]


def test_obo_terms(tmp_path: Path) -> None:
    f = tmp_path / "hp.obo"
    f.write_text(
        "format-version: 1.2\n\n[Term]\nid: HP:0000001\nname: All\n\n"
        '[Term]\nid: HP:0000002\nname: Abnormality of body height\ndef: "Deviation from the norm." [ref]\n'
        'comment: A comment.\nsynonym: "Height abnormality" EXACT []\nis_a: HP:0001507 ! Growth abnormality\n\n'
        '[Term]\nid: HP:0000003\nname: Old\ndef: "Gone." []\nis_obsolete: true\n\n[Typedef]\nid: part_of\n'
    )
    assert list(decode_obo_terms(f, [])) == [(
        "HP:0000002",
        "Abnormality of body height (HP:0000002)\n\nDeviation from the norm.\n\nA comment.\n\n"
        "Synonyms: Height abnormality\nIs a: Growth abnormality",
    )]


def test_go_sqlite(tmp_path: Path) -> None:
    db = tmp_path / "GO.sqlite"
    con = sqlite3.connect(db)
    con.executescript(
        "CREATE TABLE go_term (_id INTEGER PRIMARY KEY, go_id TEXT, term TEXT, ontology TEXT, definition TEXT);"
        "CREATE TABLE go_synonym (_id INTEGER, synonym TEXT, secondary TEXT, like_go_id INTEGER);"
        "CREATE TABLE go_bp_parents (_id INTEGER, _parent_id INTEGER, relationship_type TEXT);"
        "CREATE TABLE go_mf_parents (_id INTEGER, _parent_id INTEGER, relationship_type TEXT);"
        "CREATE TABLE go_cc_parents (_id INTEGER, _parent_id INTEGER, relationship_type TEXT);"
        "INSERT INTO go_term VALUES (1, 'GO:0000001', 'mitochondrion inheritance', 'BP', 'The distribution.'),"
        " (2, 'GO:0048308', 'organelle inheritance', 'BP', 'The partitioning.'), (3, 'all', 'all', 'universal', '');"
        "INSERT INTO go_synonym VALUES (1, 'mitochondrial inheritance', NULL, 0), (1, 'GO:0000002', 'GO:0000002', 1);"
        "INSERT INTO go_bp_parents VALUES (1, 2, 'isa'), (1, 2, 'part of');"
    )
    con.commit()
    con.close()
    docs = dict(decode_go_sqlite(db, []))
    assert set(docs) == {"GO:0000001", "GO:0048308"}
    assert docs["GO:0000001"] == (
        "mitochondrion inheritance (biological process, GO:0000001)\n\nThe distribution.\n\n"
        "Synonyms: mitochondrial inheritance\nIs a: organelle inheritance\nPart of: organelle inheritance"
    )


def test_metamath_sections_elide_proofs(tmp_path: Path) -> None:
    mm = tmp_path / "set.mm"
    mm.write_text(
        "$( header $)\n$(\n#*#*#*#*\n  Chapter one\n#*#*#*#*\n$)\n"
        "  ax-1 $a |- ( ph -> ( ps -> ph ) ) $.\n  th1 $p |- ph $=\n    ( wi ax-1 ) ABCDE $.\n"
        "$(\n=-=-=-=-\n  Section two\n=-=-=-=-\n$)\n  th2 $p |- ps $= ? $.\n"
    )
    docs = list(decode_metamath_sections(mm, []))
    assert [u for u, _ in docs] == ["s00000", "s00001", "s00002"]
    assert docs[0][1].strip() == "$( header $)"
    assert "Chapter one" in docs[1][1] and "ax-1 $a" in docs[1][1]
    assert "ABCDE" not in docs[1][1] and "th1 $p |- ph $= ... $." in docs[1][1]
    assert docs[2][1].startswith("$(\n=-=-=-=-\n  Section two")


def test_sword_ztext_chapters(tmp_path: Path) -> None:
    osis = (
        b'<chapter osisID="Gen.1" sID="Gen.1"/><title type="chapter">Creation</title>'
        b'<div type="x-p" sID="p1"/><w lemma="H1">In</w> <w>the</w> <w>beginning</w>,'
        b'<note placement="foot">a note</note><w>God</w> created.<chapter eID="Gen.1"/>'
        b'<chapter osisID="Gen.2" sID="Gen.2"/><w>Thus</w> <w>the</w> heavens &amp; earth'
        b'<transChange type="added">were</transChange> finished.<chapter eID="Gen.2"/>'
    )
    half = len(osis) // 2
    blocks = [zlib.compress(osis[:half]), zlib.compress(osis[half:])]
    index, offset = b"", 0
    for raw, block in zip((osis[:half], osis[half:]), blocks, strict=True):
        index += struct.pack("<III", offset, len(block), len(raw))
        offset += len(block)
    (tmp_path / "ot.bzz").write_bytes(b"".join(blocks))
    (tmp_path / "ot.bzs").write_bytes(index)
    docs = list(decode_sword_ztext(tmp_path / "ot.bzz", []))
    assert [u for u, _ in docs] == ["Gen.1", "Gen.2"]
    assert docs[0][1].split() == ["Gen", "1", "Creation", "In", "the", "beginning,", "God", "created."]
    assert "a note" not in docs[0][1]
    assert docs[1][1].endswith("Thus the heavens & earth were finished.")
