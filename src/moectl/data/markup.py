"""Strip document markup (HTML, roff, POD, reStructuredText, TeX) down to plain text.

Every function here is pure: a string in, a string out. They aim at *readable training
text*, not at faithful rendering: headings become their own paragraphs, list items start
with ``- ``, code blocks keep their indentation, and navigation chrome is dropped.
``normalise_whitespace`` is applied to every document after stripping, whatever its markup.
"""

from __future__ import annotations

import html
import re
import unicodedata
from collections.abc import Callable, Iterable
from html.parser import HTMLParser

__all__ = [
    "MARKUPS",
    "normalise_whitespace",
    "strip",
    "strip_html",
    "strip_pod",
    "strip_roff",
    "strip_rst",
    "strip_tex",
]

# --------------------------------------------------------------------------------------
# whitespace
# --------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_BLANK_RUN = re.compile(r"\n{3,}")


def normalise_whitespace(text: str) -> str:
    """Return ``text`` in NFC with Unix newlines, no trailing spaces, at most one blank line in a row.

    Indentation (leading spaces and tabs) is kept, so code stays code.
    """
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u00a0", " ")
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _BLANK_RUN.sub("\n\n", text)
    return text.strip("\n")


def _collapse_spaces(text: str) -> str:
    """Collapse runs of spaces/tabs inside lines (for prose produced by a stripper)."""
    return "\n".join(re.sub(r"[ \t]+", " ", line).strip() for line in text.split("\n"))


# --------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------

_BLOCK_TAGS = frozenset((
    "address", "article", "blockquote", "caption", "dd", "details", "dialog", "div", "dl", "dt", "fieldset",
    "figcaption", "figure", "form", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "li", "main", "ol", "p", "pre",
    "section", "summary", "table", "tbody", "thead", "tfoot", "tr", "ul", "title",
))
_DEFAULT_SKIP_TAGS = frozenset(
    {"script", "style", "head", "nav", "header", "footer", "aside", "noscript", "svg", "button", "template"}
)
_VOID_TAGS = frozenset((
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr",
))


_PRE_PROTECT = str.maketrans({"\n": "\x00", " ": "\x01", "\t": "\x02"})
_PRE_RESTORE = str.maketrans({"\x00": "\n", "\x01": " ", "\x02": "\t"})


class _TextExtractor(HTMLParser):
    """Collect visible text, skipping chrome (navigation, scripts) and elements named in ``skip``."""

    def __init__(self, skip_tags: frozenset[str], skip_classes: frozenset[str]) -> None:
        super().__init__(convert_charrefs=True)
        self.skip_tags = skip_tags
        self.skip_classes = skip_classes
        self.parts: list[str] = []
        self.skip_stack: list[str] = []  # tags whose end closes a skipped element
        self.depth_stack: list[str] = []  # open tags inside a skipped element
        self.pre = 0

    def _skipped(self, tag: str, attrs: list[tuple[str, str | None]]) -> bool:
        if tag in self.skip_tags:
            return True
        if not self.skip_classes:
            return False
        for name, value in attrs:
            if name in ("class", "id") and value and any(v in self.skip_classes for v in value.split()):
                return True
        return False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.skip_stack:
            if tag not in _VOID_TAGS:
                self.depth_stack.append(tag)
            return
        if tag not in _VOID_TAGS and self._skipped(tag, attrs):
            self.skip_stack.append(tag)
            self.depth_stack = []
            return
        if tag == "pre":
            self.pre += 1
            self.parts.append("\n\n")
        elif tag == "br":
            self.parts.append("\n")
        elif tag == "li":
            self.parts.append("\n- ")
        elif tag in ("td", "th"):
            self.parts.append(" ")
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n\n")
        elif tag == "img":
            alt = dict(attrs).get("alt")
            if alt and self.parts and not self.parts[-1].endswith(" "):
                self.parts.append(" ")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if not self.skip_stack and tag == "br":
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self.skip_stack:
            if self.depth_stack:
                # pop up to and including the matching open tag (tolerates unclosed children)
                if tag in self.depth_stack:
                    while self.depth_stack and self.depth_stack.pop() != tag:
                        pass
                return
            if tag == self.skip_stack[-1]:
                self.skip_stack.pop()
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
            self.parts.append("\n\n")
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self.skip_stack:
            return
        if self.pre:
            self.parts.append(data.translate(_PRE_PROTECT))  # keep <pre> layout through space collapsing
        else:
            self.parts.append(re.sub(r"\s+", " ", data))


def strip_html(
    text: str, skip_tags: Iterable[str] = (), skip_classes: Iterable[str] = ()
) -> str:
    """Visible text of an HTML/XHTML page.

    ``<script>``, ``<style>``, ``<head>``, ``<nav>``, ``<header>``, ``<footer>`` and ``<aside>`` are
    always dropped; ``skip_tags`` adds tag names and ``skip_classes`` drops any element whose
    ``class`` or ``id`` contains one of the given names (site navigation bars and the like).
    Block elements become paragraphs, ``<li>`` becomes ``- item``, ``<pre>`` keeps its lines.
    """
    parser = _TextExtractor(_DEFAULT_SKIP_TAGS | frozenset(skip_tags), frozenset(skip_classes))
    parser.feed(text)
    parser.close()
    out = "".join(parser.parts).replace("¶", "")  # pilcrow permalink anchors
    out = _collapse_spaces(out).translate(_PRE_RESTORE)
    out = re.sub(r"(?m)^-\n+(?=[^\n-])", "- ", out)  # <li><p>text</p></li> -> "- text"
    return normalise_whitespace(out)


# --------------------------------------------------------------------------------------
# roff / troff (man pages, man and mdoc macro packages)
# --------------------------------------------------------------------------------------

_ROFF_SPECIAL = {
    "em": "—", "en": "–", "hy": "-", "mi": "-", "aq": "'", "dq": '"', "lq": "“", "rq": "”",
    "oq": "‘", "cq": "’", "Fo": "«", "Fc": "»", "fo": "‹", "fc": "›", "bu": "•", "co": "©",
    "rg": "®", "tm": "™", "de": "°", "+-": "±", "mu": "×", "di": "÷", "<=": "≤", ">=": "≥",
    "!=": "≠", "->": "→", "<-": "←", "ua": "↑", "da": "↓", "ti": "~", "ha": "^", "rs": "\\",
    "sl": "/", "ba": "|", "or": "|", "at": "@", "sh": "#", "Do": "$", "ct": "¢", "Eu": "€",
    "ss": "ß", "ae": "æ", "oe": "œ", "AE": "Æ", "OE": "Œ", "bv": "|", "lh": "☜", "rh": "☞",
    "a:": "ä", "o:": "ö", "u:": "ü", "A:": "Ä", "O:": "Ö", "U:": "Ü", "e'": "é", "e`": "è",
    "a`": "à", "c,": "ç", "n~": "ñ", "'e": "é", "`e": "è", "'a": "á", "'o": "ó", "'u": "ú",
    "'i": "í", "~n": "ñ", "ga": "`", "aa": "´", "ul": "_", "rn": "‾", "sq": "□", "pc": "·",
    "dg": "†", "Ok": "✓", "space": " ",
}
_ROFF_STRINGS = {"lq": "“", "rq": "”", "R": "®", "Tm": "™", "S": "", "Aq": "'", "Lq": "“", "Rq": "”"}

_ROFF_ESCAPE = re.compile(
    r"""\\(?:
        \[(?P<bracket>[^\]]*)\]               # \[name]
      | \((?P<paren>..)                       # \(xx
      | \*(?:\[(?P<strb>[^\]]*)\]|\((?P<strp>..)|(?P<str1>.))   # \*x \*(xx \*[name]
      | [fFgkmnMVY](?:\[[^\]]*\]|\(..|.)     # font, register, colour: dropped
      | s[-+]?(?:\d+|\(\d\d|\[\d+\])          # size: dropped
      | [hvwlLoxXNbBDHRSzZ]'[^']*'            # motions and friends with quoted args: dropped
      | (?P<lit>[-e\\.'`"^|&!%:\-0 ~c]|\n)    # one-character escapes
      | (?P<other>.)
    )""",
    re.VERBOSE,
)


def _roff_escape(m: re.Match[str]) -> str:
    if (name := m.group("bracket")) is not None:
        if name.startswith("u") and re.fullmatch(r"u[0-9A-Fa-f]{4,6}", name):
            return chr(int(name[1:], 16))
        return _ROFF_SPECIAL.get(name, "")
    if (name := m.group("paren")) is not None:
        return _ROFF_SPECIAL.get(name, "")
    for group in ("strb", "strp", "str1"):
        if (name := m.group(group)) is not None:
            return _ROFF_STRINGS.get(name, "")
    if (lit := m.group("lit")) is not None:
        return {"-": "-", "e": "\\", "\\": "\\", ".": ".", "'": "'", "`": "`", "~": " ", "0": " ",
                " ": " ", "\n": ""}.get(lit, "")
    return ""  # \, \/ \{ \} and other typesetting-only escapes


def _roff_inline(text: str) -> str:
    """Resolve escapes in one line of roff text."""
    return _ROFF_ESCAPE.sub(_roff_escape, text)


def _roff_args(rest: str) -> list[str]:
    """Split macro arguments, honouring double quotes."""
    args: list[str] = []
    for m in re.finditer(r'"((?:[^"]|"")*)"?|(\S+)', rest):
        args.append(m.group(1).replace('""', '"') if m.group(1) is not None else m.group(2))
    return args


_ROFF_BREAKS = {"PP": "\n\n", "LP": "\n\n", "P": "\n\n", "Pp": "\n\n", "Lp": "\n\n", "sp": "\n\n",
                "Bl": "\n\n", "El": "\n\n", "Bd": "\n\n", "Ed": "\n\n", "Dl": "\n\n", "D1": "\n\n",
                "br": "\n", "RS": "\n", "RE": "\n", "in": "\n", "ti": "\n", "ne": ""}
# macros whose arguments are running text: man font macros and mdoc semantic macros
_ROFF_TEXT_MACROS = frozenset((
    "B", "I", "SM", "SB", "R", "Nm", "Nd", "Ar", "Fl", "Cm", "Pa", "Li", "Ev", "Va", "Fn", "Ft", "Fa", "Em",
    "Sy", "Dv", "Er", "Ic", "Xr", "Op", "Oo", "Oc", "Dq", "Sq", "Qq", "Ql", "Pq", "Ad", "An", "Lk", "Mt",
    "Ms", "Ux", "Bx", "At", "Nx", "Fx", "Ox", "Bsx", "St", "Tn", "Ap", "Aq", "Bq", "Brq", "Do", "Dc", "Po",
    "Pc", "No", "Vt", "Ot", "Cd", "In", "Fd", "Lb", "Rv", "Ex", "Qo", "Qc", "Eo", "Ec",
))
# mdoc macro names that may appear *inside* another macro's arguments (callable macros)
_MDOC_CALLABLE = frozenset(("Ns", "Ar", "Fl", "Cm", "Pa", "Li", "No", "Op", "Sy", "Em", "Xr", "Nm", "Xo", "Xc"))
_MDOC_PUNCT = frozenset((".", ",", ";", ":", ")", "(", "[", "]", "?", "!"))


def _mdoc_words(words: list[str]) -> str:
    """Join mdoc macro arguments: ``Fl x`` -> ``-x``, ``Xr ls 1`` -> ``ls(1)``, other callables vanish."""
    out: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w == "Fl":
            out.append("-" + (words[i + 1] if i + 1 < len(words) and words[i + 1] not in _MDOC_CALLABLE else ""))
            i += 1 if out[-1] == "-" else 2
            continue
        if w == "Xr" and i + 2 < len(words):
            out.append(f"{words[i + 1]}({words[i + 2]})")
            i += 3
            continue
        if w not in _MDOC_CALLABLE:
            out.append(w)
        i += 1
    joined = ""
    for w in out:
        joined += w if (w in _MDOC_PUNCT or not joined) else " " + w
    return _roff_inline(joined)


def _roff_macro_text(name: str, rest: str) -> str:
    """Running text carried by a font or mdoc macro line (``.B word``, ``.Fl x``, ``.Xr ls 1``)."""
    args = _roff_args(rest)
    return _mdoc_words([name, *args] if name in ("Fl", "Xr") else args)


def _roff_paragraphs(body: str) -> str:
    """Join filled lines of each paragraph; keep the lines of no-fill blocks and tagged paragraphs."""
    cleaned = []
    for p in re.split(r"\n\s*\n", re.sub(r"[ \t]+\n", "\n", body)):
        if "\n" in p.strip("\n"):
            cleaned.append("\n".join(ln.rstrip() for ln in p.strip("\n").split("\n")))
        else:
            cleaned.append(re.sub(r"[ \t]+", " ", p).strip())
    return "\n\n".join(c for c in cleaned if c.strip())


def strip_roff(text: str) -> str:
    """Plain text of a man page written in roff (``man`` or ``mdoc`` macros).

    Comments, macro definitions and formatting requests are dropped; section headings (``.SH``)
    become paragraphs of their own; the tag of a ``.TP`` paragraph gets its own line; font macros
    (``.B``, ``.BR``, ``.I`` …) keep their words; ``.nf``/``.fi`` (and ``.EX``/``.EE``) blocks keep
    their line breaks; escapes such as ``\\fB``, ``\\-``, ``\\(em`` and ``\\[u00E9]`` become the
    characters they stand for.
    """
    out: list[str] = []
    nofill = False
    tag_next = False  # after .TP the next text line is the paragraph's tag
    skip_until: str | None = None  # inside .de/.ig: skip to the terminator
    for line in text.replace("\r\n", "\n").split("\n"):
        if skip_until is not None:
            if line.strip().startswith(skip_until):
                skip_until = None
            continue
        if line.startswith(('.\\"', "'\\\"", '\\"', ".\\#", "\\#")) or line.strip() in (".", "'"):
            continue
        line = re.sub(r'\\".*$', "", line)  # trailing comment
        end = "\n" if nofill or tag_next else " "
        if line[:1] not in (".", "'"):
            out.append(_roff_inline(line) + end)
            tag_next = False
            continue
        m = re.match(r"[.']\s*([^\s\\]+)\s*(.*)$", line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        if name in ("de", "de1", "am", "ig"):
            skip_until = "." + rest.split()[0] if name == "ig" and rest else ".."
        elif name in ("nf", "EX", "fi", "EE"):
            nofill = name in ("nf", "EX")
            out.append("\n\n")
        elif name in ("SH", "SS", "Sh", "Ss"):
            out.append(f"\n\n{_roff_inline(' '.join(_roff_args(rest)))}\n\n")
        elif name in ("TP", "TQ"):
            out.append("\n\n")
            tag_next = True
        elif name in ("IP", "HP", "It"):
            tag = _mdoc_words([a for a in _roff_args(rest) if not re.fullmatch(r"-?\d+[nmi]?", a)])
            out.append("\n\n" + (tag + "\n" if tag else ""))
        elif name in _ROFF_TEXT_MACROS:
            out.append(_roff_macro_text(name, rest) + end)
            tag_next = False
        elif len(name) == 2 and name[0] in "BIR" and name[1] in "BIR":  # alternating fonts: .BR .IR …
            out.append(_roff_inline("".join(_roff_args(rest))) + end)
            tag_next = False
        elif name in _ROFF_BREAKS:
            out.append(_ROFF_BREAKS[name])
        # any other request (.TH, .ft, .UR, .if, tbl's .TS …) carries no running text: dropped
    return normalise_whitespace(_roff_paragraphs("".join(out)))


# --------------------------------------------------------------------------------------
# POD (Perl documentation)
# --------------------------------------------------------------------------------------

_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_entity(name: str) -> str:
    if name in _POD_ENTITIES:
        return _POD_ENTITIES[name]
    if name.isdigit():
        return chr(int(name))
    if name.lower().startswith("0x"):
        return chr(int(name, 16))
    return html.unescape(f"&{name};")


def _pod_codes(text: str) -> str:
    """Resolve POD formatting codes (B<>, I<>, C<>, L<>, E<>, F<>, S<>, X<>, Z<>), nesting allowed."""
    out: list[str] = []
    i = 0
    n = len(text)
    # stack of (code, closing delimiter, buffer start)
    stack: list[tuple[str, str, int]] = []
    while i < n:
        m = re.match(r"([A-Z])(<+)(\s+|(?=\S))", text[i:]) if text[i].isupper() else None
        if m and (len(m.group(2)) == 1 or m.group(3)):
            closer = ">" * len(m.group(2))
            if len(m.group(2)) > 1:
                closer = " " + closer
            stack.append((m.group(1), closer, len(out)))
            i += m.end()
            continue
        if stack:
            code, closer, start = stack[-1]
            if text.startswith(closer, i) or (closer.startswith(" ") and text.startswith(closer.strip(), i)
                                               and (i == 0 or text[i - 1].isspace())):
                stack.pop()
                inner = "".join(out[start:]).strip() if len(closer) > 1 else "".join(out[start:])
                del out[start:]
                if code == "E":
                    inner = _pod_entity(inner)
                elif code in ("X", "Z"):
                    inner = ""
                elif code == "L":
                    if "|" in inner:
                        inner = inner.split("|", 1)[0]
                    elif inner.startswith(("http:", "https:", "ftp:", "mailto:")):
                        pass
                    else:
                        inner = inner.replace('"', "").replace("/", " ").strip()
                elif code == "S":
                    inner = inner.replace(" ", "\u00a0")
                out.append(inner)
                i += len(closer.strip()) if text.startswith(closer.strip(), i) else len(closer)
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def strip_pod(text: str) -> str:
    """Plain text of a POD document (Perl's documentation format).

    Code outside ``=pod``…``=cut`` is dropped; ``=head1`` … become paragraphs; ``=item`` becomes a
    ``- `` item; verbatim (indented) paragraphs are kept as they are; ``=begin``/``=end`` and
    ``=for`` blocks for other formatters are dropped.
    """
    paragraphs = re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n"))
    out: list[str] = []
    in_pod = text.lstrip().startswith("=")
    skip_format: str | None = None
    for para in paragraphs:
        stripped = para.strip("\n")
        if not stripped:
            continue
        if stripped.startswith("="):
            m = re.match(r"=(\w+)\s*(.*)", stripped, re.S)
            if not m:
                continue
            cmd, arg = m.group(1), m.group(2).strip()
            if cmd == "cut":
                in_pod = False
                continue
            in_pod = True
            if cmd == "begin":
                skip_format = arg.split()[0] if arg else ""
                if skip_format in ("text", "pod"):
                    skip_format = None
                continue
            if cmd == "end":
                skip_format = None
                continue
            if skip_format is not None:
                continue
            if cmd.startswith("head"):
                out.append(_pod_codes(re.sub(r"\s+", " ", arg)))
            elif cmd == "item":
                arg = re.sub(r"\s+", " ", arg)
                if arg in ("*", "") or re.fullmatch(r"\d+\.?", arg):
                    out.append("-")
                else:
                    out.append("- " + _pod_codes(arg.lstrip("* ")))
            elif cmd == "for":
                continue
            # =pod =over =back =encoding: no text
            continue
        if not in_pod or skip_format is not None:
            continue
        if para[:1] in (" ", "\t"):
            out.append(stripped)  # verbatim
        else:
            text_para = _pod_codes(re.sub(r"\s+", " ", stripped))
            if out and out[-1] == "-":
                out[-1] = "- " + text_para
            else:
                out.append(text_para)
    return normalise_whitespace("\n\n".join(p.replace("\u00a0", " ") for p in out if p != "-"))


# --------------------------------------------------------------------------------------
# reStructuredText
# --------------------------------------------------------------------------------------

_RST_ADORNMENT = re.compile(r"^([=\-`:'\"~^_*+#<>.])\1{2,}\s*$")
_RST_FILE_FIELD = re.compile(r"^:(?:tocdepth|orphan|nosearch|nocomments|og:\w+|Author|Copyright|Date|Version)\b.*$")
_RST_ROLE = re.compile(r":[\w:.+-]+:`((?:[^`\\]|\\.)*)`")
_RST_REF = re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?")
_RST_NAMED = re.compile(r"`([^`]+)`__?")
_RST_CODE = re.compile(r"``((?:[^`]|`(?!`))+)``")
_RST_EMPH = re.compile(r"(?<![\w*\\])\*\*?(?=\S)([^*\n]+?)(?<=\S)\*\*?(?![\w*])")
_RST_FOOTREF = re.compile(r"\s?\[(?:#\w*|\*|\d+|#)\]_")
_RST_SUBST = re.compile(r"\|([\w -]+)\|_{0,2}")
# directives whose argument and body are prose or code worth keeping (all others are dropped whole)
_RST_KEEP_BODY = frozenset((
    "note", "warning", "tip", "important", "caution", "attention", "danger", "error", "hint", "admonition",
    "seealso", "versionadded", "versionchanged", "deprecated", "rubric", "topic", "sidebar", "code-block",
    "code", "sourcecode", "epigraph", "pull-quote", "container", "function", "method", "class", "attribute",
    "data", "exception", "decorator", "module", "describe", "option", "envvar", "cmdoption", "program",
    "c:function", "c:type", "c:macro", "c:member", "c:struct", "c:var",
))


_RST_VERSION_NOTES = {
    "versionadded": "New in version",
    "versionchanged": "Changed in version",
    "deprecated": "Deprecated since version",
}


def _rst_role(m: re.Match[str]) -> str:
    inner = m.group(1).replace("\\", "")
    role = m.group(0)[1 : m.group(0).index(":`")]
    if role in ("pep", "rfc"):
        return f"{role.upper()} {inner}"
    if "<" in inner and inner.endswith(">"):
        title = inner[: inner.index("<")].strip()
        return title or inner[inner.index("<") + 1 : -1]
    return inner.lstrip("~!")


def _rst_inline(line: str) -> str:
    line = _RST_ROLE.sub(_rst_role, line)
    line = _RST_REF.sub(lambda m: m.group(1), line)
    line = _RST_CODE.sub(lambda m: m.group(1), line)
    line = _RST_NAMED.sub(lambda m: m.group(1), line)
    line = _RST_EMPH.sub(lambda m: m.group(1), line)
    line = _RST_FOOTREF.sub("", line)
    line = _RST_SUBST.sub(lambda m: m.group(1), line)
    return line


def strip_rst(text: str) -> str:
    """Plain text of a reStructuredText document (Sphinx flavour).

    Section adornment lines are dropped (the title stays), comments and directives without prose
    (``toctree``, ``image``, ``include``, ``_label:`` targets, substitutions) are dropped with
    their option and body blocks, admonitions and code blocks keep their body, roles such as
    ``:func:`name``` and links such as ```text <url>`_`` keep their visible text, and a
    paragraph ending in ``::`` ends in ``:``.
    """
    lines = text.replace("\r\n", "\n").split("\n")
    out: list[str] = []
    skip_indent: int | None = None  # drop an indented block under a dropped directive/comment
    option_indent: int | None = None  # drop :option: lines directly under a kept directive
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        bare = line.strip()
        if skip_indent is not None:
            if not bare or indent > skip_indent:
                continue
            skip_indent = None
        if option_indent is not None:
            if bare.startswith(":") and indent > option_indent and re.match(r":[\w -]+:", bare):
                continue
            option_indent = None
        if _RST_FILE_FIELD.match(line):
            continue
        if _RST_ADORNMENT.match(line) and (not out or not out[-1].strip() or len(bare) >= len(out[-1].strip())):
            if out and out[-1].strip():
                out[-1] = out[-1].strip()  # a title (centred titles under an overline are indented)
            continue
        if bare.startswith(".."):
            m = re.match(r"\.\.\s+([\w:-]+)::\s*(.*)$", bare)
            if m and m.group(1) in _RST_KEEP_BODY:
                title = _rst_inline(m.group(2)).strip()
                if m.group(1) in _RST_VERSION_NOTES:
                    title = f"{_RST_VERSION_NOTES[m.group(1)]} {title}." if title else ""
                out.append(" " * indent + title if title else "")
                option_indent = indent
                continue
            skip_indent = indent  # comment, target, substitution definition or prose-free directive
            continue
        if bare.endswith("::"):
            head = line.rstrip()[:-2].rstrip()
            out.append(_rst_inline(head + ":") if head.strip() else "")
            continue
        out.append(_rst_inline(line))
    return normalise_whitespace("\n".join(out))


# --------------------------------------------------------------------------------------
# TeX / LaTeX (and TeX-like help formats such as HOL Light's .doc files)
# --------------------------------------------------------------------------------------

_TEX_MATH = re.compile(r"(?<!\\)\$\$.+?(?<!\\)\$\$|(?<!\\)\$.+?(?<!\\)\$|\\\[.+?\\\]|\\\(.+?\\\)", re.S)
_TEX_DROP_ENVS = ("figure", "tikzpicture", "picture", "comment")
_TEX_TEXT_CMDS = re.compile(
    r"\\(?:text(?:bf|it|tt|sf|rm|sc|up|normal)?|emph|mbox|hbox|underline|mathrm|mathbf|mathit|mathsf|"
    r"mathtt|mathcal|mathbb|operatorname|section|subsection|subsubsection|paragraph|chapter|title|"
    r"caption|footnote|url|[A-Z]+)\*?\s*\{([^{}]*)\}"
)


def strip_tex(text: str) -> str:
    """Plain text of TeX/LaTeX source.

    Comments, the preamble, ``\\label``/``\\ref``-like commands and figure environments are
    dropped; text-carrying commands (``\\emph{x}``, ``\\section{x}``, ``\\textbf{x}``, and
    upper-case help macros such as ``\\SYNOPSIS``) keep their argument; other commands vanish
    and braces are removed. Mathematics is kept as written between its dollars.
    """
    text = text.replace("\r\n", "\n")
    text = re.sub(r"(?<!\\)%[^\n]*", "", text)
    if "\\begin{document}" in text:
        text = text.split("\\begin{document}", 1)[1]
    text = text.split("\\end{document}", 1)[0]
    maths: list[str] = []

    def protect(m: re.Match[str]) -> str:
        maths.append(m.group(0))
        return f"\x00{len(maths) - 1}\x00"

    text = _TEX_MATH.sub(protect, text)
    for env in _TEX_DROP_ENVS:
        text = re.sub(rf"\\begin\{{{env}\*?\}}.*?\\end\{{{env}\*?\}}", "", text, flags=re.S)
    text = re.sub(r"\\(?:label|ref|eqref|cite|pageref|index|input|include|bibliography\w*|usepackage|"
                  r"documentclass|vspace|hspace|setlength|newcommand|renewcommand)\*?(?:\[[^\]]*\])?"
                  r"\{[^{}]*\}(?:\{[^{}]*\})?", "", text)
    text = re.sub(r"\\(?:begin|end)\{[^{}]*\}(?:\[[^\]]*\])?(?:\{[^{}]*\})?", "\n", text)
    for _ in range(4):  # unwrap nested text commands from the inside out
        text = _TEX_TEXT_CMDS.sub(lambda m: m.group(1), text)
    text = re.sub(r"\s*\\item\b\s*", "\n- ", text)
    text = re.sub(r"\\\\", "\n", text)
    text = re.sub(r"\\([{}%$&#_])", r"\1", text)
    text = re.sub(r"\\[A-Za-z]+\*?(?:\[[^\]]*\])?", "", text)  # remaining commands
    text = re.sub(r"(?<!\\)[{}]", "", text)
    text = text.replace("~", " ").replace("``", "“").replace("''", "”")
    text = re.sub(r"\x00(\d+)\x00", lambda m: maths[int(m.group(1))], text)
    paragraphs = [re.sub(r"[ \t]+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return normalise_whitespace("\n\n".join(p for p in paragraphs if p))


# --------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------


def _identity(text: str) -> str:
    return normalise_whitespace(text)


MARKUPS: dict[str, Callable[[str], str]] = {
    "text": _identity,
    "html": strip_html,
    "roff": strip_roff,
    "pod": strip_pod,
    "rst": strip_rst,
    "tex": strip_tex,
}


def strip(text: str, markup: str, **options: object) -> str:
    """Strip ``markup`` (one of :data:`MARKUPS`) from ``text``; options go to the stripper (HTML only)."""
    if markup not in MARKUPS:
        raise ValueError(f"unknown markup {markup!r}; expected one of {', '.join(sorted(MARKUPS))}")
    if markup == "html":
        return strip_html(text, **options)  # type: ignore[arg-type]
    return MARKUPS[markup](text)
