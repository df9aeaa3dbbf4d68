"""Evaluation sets imported from files the user supplies, not from a wheel: MMLU-Pro.

MMLU-Pro (Wang et al. 2024, "MMLU-Pro: A More Robust and Challenging Multi-Task Language
Understanding Benchmark"; ``TIGER-Lab/MMLU-Pro``, MIT) is not in any PyPI wheel or Debian package
and moectl never talks to a dataset hub (see :mod:`moectl.eval.catalog`). The user downloads the
Hugging Face dataset on a machine with the hub and imports it with
``moectl data fetch-evals --mmlu-pro PATH``, where PATH is

- the downloaded dataset folder (searched recursively, hidden folders skipped: the hub's layout is
  ``data/test-00000-of-00001.parquet`` and ``data/validation-00000-of-00001.parquet``), or
- files whose names carry their split (``test*.parquet``, ``mmlu_pro_validation.jsonl``, ...),

in parquet, JSON Lines or JSON (a list of rows); shards of one split are concatenated in name
order. Everything is read and checked in memory before anything is written. Refused
(:class:`~moectl.eval.convert.ConversionError`, naming the file, row and field): a row without a
catalogued field, ``options`` that is not a list, an ``answer_index`` outside ``options``.
Imported with an :class:`EvalSetWarning`: a split whose row count differs from the documented
size (12,032 test, 70 validation), categories outside the paper's 14 or missing from the file,
an ``answer`` letter that disagrees with ``answer_index``.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moectl.errors import MoectlFileError
from moectl.eval.catalog import MMLU_PRO_CATEGORIES, EvalSet
from moectl.eval.convert import ConversionError

Row = dict[str, Any]
SUFFIXES = (".parquet", ".jsonl", ".json")
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class EvalSetWarning(UserWarning):
    """A user's file differs from the documented set (rows, categories); it was imported anyway."""


def category_slug(category: str) -> str:
    """Folder and task-name form of a category: ``"computer science"`` -> ``"computer_science"``."""
    return re.sub(r"[^a-z0-9]+", "_", str(category).strip().lower()).strip("_") or "unknown"


def read_rows_file(path: Path) -> list[Row]:
    """Rows of a parquet, JSON Lines or JSON (list of rows, or ``{"data": [...]}``) file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)  # a JSON document; JSON Lines with more than one row fail here
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if isinstance(data, list):
        return data
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ConversionError(f"{path}: line {n} is not JSON ({err.msg})") from None
    return rows


def split_of(path: Path, splits: Sequence[str]) -> str | None:
    """The split a file name names as a word (``test-00000-of-00001.parquet`` -> ``test``), if one."""
    stem = path.name.lower()
    found = [s for s in splits if re.search(rf"(?:^|[^a-z]){re.escape(s)}(?:[^a-z]|$)", stem)]
    return found[0] if len(found) == 1 else None


def find_split_files(paths: Sequence[Path], splits: Sequence[str]) -> dict[str, list[Path]]:
    """``{split: [files]}`` from folders (searched recursively) and files (split from the name)."""
    found: dict[str, list[Path]] = {s: [] for s in splits}
    for path in paths:
        path = Path(path).expanduser()
        if path.is_dir():
            for file in sorted(path.rglob("*")):
                hidden = any(part.startswith(".") for part in file.relative_to(path).parts)
                split = split_of(file, splits)
                if file.is_file() and not hidden and file.suffix in SUFFIXES and split:
                    found[split].append(file)
        elif path.is_file():
            split = split_of(path, splits)
            if path.suffix not in SUFFIXES or split is None:
                raise ConversionError(
                    f"{path}: expected a {'/'.join(SUFFIXES)} file whose name says its split "
                    f"({' or '.join(splits)}), e.g. test-00000-of-00001.parquet"
                )
            found[split].append(path)
        else:
            raise MoectlFileError(f"{path} does not exist")
    for split, files in found.items():
        kinds = {f.suffix for f in files}
        if len(kinds) > 1:
            raise ConversionError(
                f"several formats for split {split!r}: {', '.join(map(str, files))}; pass the files of one"
            )
        found[split] = sorted(dict.fromkeys(files), key=lambda f: f.name)
    return found


def _check_fields(spec: EvalSet, rows: list[Row], files: list[Path]) -> None:
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConversionError(f"{spec.name}: row {n} of {', '.join(map(str, files))} is not an object")
        missing = [f for f in spec.fields if f not in row]
        if missing:
            raise ConversionError(
                f"{spec.name}: row {n} of {', '.join(map(str, files))} lacks field(s) "
                f"{', '.join(repr(f) for f in missing)}; {spec.title} rows have {', '.join(spec.fields)}"
            )


def _mmlu_pro_rows(rows: list[Row], where: str, notes: list[str]) -> list[Row]:
    """Options as strings, ``answer_index`` an int inside them (else refused); letter mismatches noted."""
    out, disagree = [], 0
    for n, row in enumerate(rows):
        options = row["options"]
        if not isinstance(options, (list, tuple)) or not options:
            raise ConversionError(f"mmlu_pro: row {n} of {where}: 'options' is not a non-empty list")
        try:
            index = int(row["answer_index"])
        except (TypeError, ValueError):
            index = -1
        if not 0 <= index < len(options):
            raise ConversionError(
                f"mmlu_pro: row {n} of {where}: 'answer_index' {row['answer_index']!r} is not an index "
                f"into its {len(options)} options"
            )
        disagree += str(row["answer"]).strip() != _LETTERS[index]
        out.append({**row, "options": [str(o) for o in options], "answer_index": index})
    if disagree:
        notes.append(
            f"mmlu_pro: {disagree} row(s) of {where} have an 'answer' letter that disagrees with "
            "'answer_index'; moectl scores against 'answer_index'"
        )
    return out


def convert_user_set(
    spec: EvalSet, paths: Sequence[str | Path], check_sizes: bool = True
) -> tuple[dict[str, list[Row]], dict[str, list[Path]], list[str]]:
    """Read and check a user-supplied set: ``(rows per split, source files per split, warnings)``.

    Every split of ``spec`` must be found. Each warning is also issued as an
    :class:`EvalSetWarning`.
    """
    files = find_split_files([Path(p) for p in paths], list(spec.splits))
    notes: list[str] = []
    out: dict[str, list[Row]] = {}
    for split, source in spec.splits.items():
        if not files[split]:
            raise ConversionError(
                f"{spec.title}: no {split} file in {', '.join(map(str, paths))}; the "
                f"{spec.extra.get('hub_id', spec.name)} dataset has {' and '.join(spec.splits)} splits "
                f"(e.g. {source.members[0]}); pass its folder or both files"
            )
        rows = [row for f in files[split] for row in read_rows_file(f)]
        where = ", ".join(map(str, files[split]))
        if not rows:
            raise ConversionError(f"{spec.name}/{split}: {where} holds no rows")
        _check_fields(spec, rows, files[split])
        if spec.name == "mmlu_pro":
            rows = _mmlu_pro_rows(rows, where, notes)
        if check_sizes and len(rows) != source.rows:
            notes.append(
                f"{spec.name}/{split}: {len(rows):,} rows in {where}, {spec.title} has {source.rows:,}; "
                "imported anyway, but results are not comparable with the published ones"
            )
        out[split] = rows
    if spec.name == "mmlu_pro":
        seen = {str(r["category"]) for rows in out.values() for r in rows}
        unknown = sorted(seen - set(MMLU_PRO_CATEGORIES))
        if unknown:
            notes.append(f"mmlu_pro: categories {unknown} are not among MMLU-Pro's 14; no task reads them")
        absent = [c for c in MMLU_PRO_CATEGORIES if c not in seen]
        if absent:
            tasks = ", ".join(f"mmlu_pro_{category_slug(c)}" for c in absent)
            notes.append(
                f"mmlu_pro: no rows of categories {absent}: tasks {tasks} and the mmlu_pro group cannot run"
            )
    for note in notes:
        warnings.warn(note, EvalSetWarning, stacklevel=2)
    return out, files, notes


def group_by_category(rows: list[Row]) -> dict[str, list[Row]]:
    """Rows per category slug (``by_category/SLUG/SPLIT.jsonl``), in file order."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(category_slug(row["category"]), []).append(row)
    return groups


def category_counts(rows: list[Row]) -> dict[str, int]:
    """Rows per category value."""
    return dict(sorted(Counter(str(r["category"]) for r in rows).items()))


__all__ = [
    "EvalSetWarning",
    "category_counts",
    "category_slug",
    "convert_user_set",
    "find_split_files",
    "group_by_category",
    "read_rows_file",
    "split_of",
]
