"""Deterministic document splits and content keys.

A document's split depends on its id alone (a salted SHA-256 of it), so it is stable across runs,
machines and Python versions and independent of the order in which documents are read. The same
hash, with another salt, orders documents when a source is capped.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["DEFAULT_FRACTIONS", "SPLITS", "content_key", "split_of", "unit_hash"]

SPLITS: tuple[str, ...] = ("train", "validation", "test")
DEFAULT_FRACTIONS: tuple[float, float, float] = (0.98, 0.01, 0.01)


def unit_hash(key: str, salt: str) -> float:
    """A number in [0, 1) drawn uniformly by SHA-256 from ``salt`` and ``key``."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(doc_id: str, fractions: tuple[float, float, float] = DEFAULT_FRACTIONS) -> str:
    """The split (``train``/``validation``/``test``) of the document with id ``doc_id``."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"split fractions must be three non-negative numbers summing to 1, got {fractions}")
    u = unit_hash(doc_id, "split")
    if u < fractions[0]:
        return "train"
    if u < fractions[0] + fractions[1]:
        return "validation"
    return "test"


def content_key(text: str) -> str:
    """Key for exact-duplicate detection: SHA-1 of the text, case-folded with whitespace collapsed."""
    return hashlib.sha1(re.sub(r"\s+", " ", text).strip().casefold().encode()).hexdigest()
