"""MATH answer equivalence: normalise two LaTeX answers and compare them (TE-MoE's MATH metric).

The MATH repository's ``is_equiv`` strips both answers to a canonical string and compares the
strings. This module does the same job with its own normaliser (not a copy), in this order:

1. drop surrounding ``$``, ``\\(\\)``, ``\\boxed{}``/``\\fbox{}``, ``\\text{}``/``\\mbox{}`` wrappers of
   the whole answer, and a trailing full stop;
2. drop layout noise: ``\\left``/``\\right``, ``\\!``, ``\\,``, ``\\;``, ``\\ ``, ``\\displaystyle``,
   degree marks (``^\\circ``, ``^{\\circ}``), ``\\%``/``%``, escaped dollars, and a trailing
   ``\\text{...}`` unit (``5 \\text{ cm}`` is 5);
3. unify spellings: ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\le``/``\\ge`` forms, ``\\neq``;
4. a short variable assignment on the left (``x = 5``, ``k=3``) keeps only the right side;
5. brace the shorthand arguments of ``\\frac12``/``\\frac1b`` and ``\\sqrt2`` -> ``\\frac{1}{2}``,
   ``\\sqrt{2}``; a plain ``a/b`` of two integers becomes ``\\frac{a}{b}``; a leading ``.5`` gets
   its zero;
6. remove all whitespace.

Then two answers are equal when the strings are equal, or (an extension) when both are plain
numbers with the same value (``0.50`` and ``\\frac{1}{2}``, ``1,000`` and ``1000``).
"""

from __future__ import annotations

import re
from fractions import Fraction

_WRAPPERS = ("\\boxed", "\\fbox", "\\text", "\\textbf", "\\mbox", "\\mathrm")
_NOISE = (
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\displaystyle",
    "^{\\circ}",
    "^\\circ",
    "\\%",
    "\\$",
    "$",
    "%",
)
_SPELLINGS = {
    "\\dfrac": "\\frac",
    "\\tfrac": "\\frac",
    "\\leq": "\\le",
    "\\geq": "\\ge",
    "\\ne ": "\\neq ",
    "\\lt": "<",
    "\\gt": ">",
}


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed x``) in ``text``; braces matched."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    head = "\\boxed" if rest.startswith("\\boxed") else "\\fbox"
    rest = rest[len(head) :]
    if rest.startswith(" "):  # \boxed 5
        return rest[1:].split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced


def _unwrap(s: str) -> str:
    """Remove wrappers that enclose the whole answer, repeatedly."""
    changed = True
    while changed:
        changed = False
        s = s.strip()
        for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s, changed = s[len(left) : len(s) - len(right)], True
        for wrapper in _WRAPPERS:
            if s.startswith(wrapper + "{") and _closing(s, len(wrapper)) == len(s) - 1:
                s, changed = s[len(wrapper) + 1 : -1], True
        if s.endswith("."):
            s, changed = s[:-1], True
    return s


def _closing(s: str, open_at: int) -> int:
    """Index of the brace closing the one at ``open_at`` (-1 if unbalanced)."""
    depth = 0
    for i in range(open_at, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _brace_shorthand(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{b}`` -> ``\\frac{1}{b}``, ``\\sqrt3`` -> ``\\sqrt{3}``."""
    s = re.sub(r"\\sqrt\s*([^\s{\\])", r"\\sqrt{\1}", s)
    out, i = [], 0
    while True:
        j = s.find("\\frac", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i : j + 5])
        k = j + 5
        for _ in range(2):  # numerator, denominator
            while k < len(s) and s[k] == " ":
                k += 1
            if k >= len(s):
                break
            if s[k] == "{":
                end = _closing(s, k)
                end = len(s) - 1 if end < 0 else end
                out.append(s[k : end + 1])
                k = end + 1
            elif s[k] == "\\":
                out.append(s[k : k + 1])  # a command argument: leave as written
                k += 1
                break
            else:
                out.append("{" + s[k] + "}")
                k += 1
        i = k


def normalize_math_answer(answer: str) -> str:
    """The canonical string of a MATH answer (see the module docstring for the steps)."""
    s = str(answer).replace("\n", "").replace("\\\\", "\\").strip()
    s = _unwrap(s)
    s = re.sub(r"\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]*\}\s*$", "", s).strip()  # trailing unit
    s = re.sub(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}", r"\1", s)  # inner \text{...}
    for noise in _NOISE:
        s = s.replace(noise, "")
    s = s.replace("\\ ", "")
    for old, new in _SPELLINGS.items():
        s = s.replace(old, new)
    s = _unwrap(s)
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2 and parts[0].strip():
        s = parts[1]
    s = _brace_shorthand(s)
    s = re.sub(r"\s+", "", s)
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    if s.startswith("."):
        s = "0" + s
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)
    return s


def _as_number(s: str) -> Fraction | None:
    """The value of a plain number: ``12``, ``-0.5``, ``1,000``, ``\\frac{3}{4}``, ``-\\frac{3}{4}``."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", s)
    if m:
        if int(m.group(3)) == 0:
            return None
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) else value
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", s):
        return Fraction(s)
    return None


def is_equiv(prediction: str | None, reference: str | None) -> bool:
    """Whether two MATH answers are the same after normalisation (both None: False)."""
    if prediction is None or reference is None:
        return False
    a, b = normalize_math_answer(prediction), normalize_math_answer(reference)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and x == y


def extract_math_answer(generation: str) -> str | None:
    """The final answer of a generated MATH solution.

    The last ``\\boxed{}``; else Minerva's "The final answer is X" sentence; else "the answer is
    X"; else the last ``$...$`` span; else None.
    """
    boxed = last_boxed(generation)
    if boxed is not None:
        return boxed
    for pattern in (r"final answer is\s*(.+?)\s*(?:\.?\s*I hope|\n|$)", r"answer is\s*(.+?)\s*(?:\n|$)"):
        found = re.findall(pattern, generation, flags=re.IGNORECASE)
        if found:
            return found[-1].strip().rstrip(".")
    spans = re.findall(r"\$([^$]+)\$", generation)
    return spans[-1] if spans else None
