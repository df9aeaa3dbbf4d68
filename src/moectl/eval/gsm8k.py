"""GSM8K exact match with the standard answer extraction.

The reference answer is what follows ``####`` in the dataset's ``answer`` field. A generation is
read as the field does (lm-eval's ``gsm8k`` / ``gsm8k-cot`` filters, the convention of the
papers' harnesses):

- **strict**: the number in "The answer is N" (chain-of-thought prompt) or "#### N";
- **flexible**: the last number in the generation.

Both sides are then cleaned as lm-eval's ``exact_match`` with ``regexes_to_ignore`` does:
commas, dollar signs and a trailing full stop removed, case ignored; the strings must be equal.
"""

from __future__ import annotations

import re

_STRICT = (re.compile(r"The answer is (\-?[0-9\.\,]+)\."), re.compile(r"#### (\-?[0-9\.\,]+)"))
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def reference_answer(answer_field: str) -> str:
    """The gold number of a GSM8K ``answer`` field (text after ``####``), cleaned."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer field has no '####' separator: {answer_field[-80:]!r}")
    return clean(answer_field.split("####")[-1])


def clean(text: str) -> str:
    """Drop commas, ``$``, everything up to ``#### `` and a trailing full stop; trim; lower case."""
    text = re.sub(r"(?s).*#### ", "", text)
    text = text.replace(",", "").replace("$", "").strip()
    return re.sub(r"\.$", "", text).strip().lower()


def extract_strict(generation: str) -> str | None:
    """The number after "The answer is" (first match) or "####"; None when absent."""
    for pattern in _STRICT:
        found = pattern.search(generation)
        if found:
            return found.group(1)
    return None


def extract_flexible(generation: str) -> str | None:
    """The last number-like span of the generation; None when there is none."""
    found = _FLEXIBLE.findall(generation)
    if not found:
        return None
    last = found[-1]
    return last[0] or last[1]


def exact_match(generation: str, answer_field: str) -> dict[str, bool]:
    """``{"strict": bool, "flexible": bool}`` for one generation against a GSM8K answer field."""
    gold = reference_answer(answer_field)
    out = {}
    for name, extract in (("strict", extract_strict), ("flexible", extract_flexible)):
        pred = extract(generation)
        out[name] = pred is not None and clean(pred) == gold
    return out
