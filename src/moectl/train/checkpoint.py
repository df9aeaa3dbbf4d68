"""Atomic checkpoints: a step folder is written beside its final name and renamed into place.

``out/checkpoints/step-000100/`` holds the model (``save_pretrained``: loads with plain
transformers), the tokenizer, and ``trainer_state.pt`` (optimizer, scheduler, step, RNG states);
``out/checkpoints/latest`` names the newest complete one. A crash mid-write leaves only a
``.tmp-*`` folder, which the next save removes; the previous checkpoint stays intact.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moectl.fileio import usual_modes


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_dir_atomic(final: Path, write: Callable[[Path], None], overwrite: bool = True) -> Path:
    """Call ``write(tmp)`` on a fresh ``.tmp-NAME`` folder beside ``final``, then rename it to ``final``.

    A crash inside ``write`` leaves only the temporary folder (removed by the next write of the same
    name); an existing ``final`` is replaced only once the new one is complete, and only with
    ``overwrite`` (else FileExistsError before anything is written). Every file gets the usual mode
    (0666 less the umask), whatever wrote it.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists (pass overwrite / --overwrite to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write(tmp)
    usual_modes(tmp)
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def save_checkpoint(out: Path, step: int, model, tokenizer, state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically; keep the newest ``keep`` checkpoints."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        torch.save({**state, "step": step, "rng": rng}, tmp / "trainer_state.pt")

    return commit_checkpoint(write_dir_atomic(root / f"step-{step:06d}", write), keep)


def commit_checkpoint(final: Path, keep: int = 2) -> Path:
    """Point ``latest`` (beside ``final``) at the complete checkpoint ``final``, then delete all but
    the newest ``keep`` ``step-*`` folders there (none with ``keep`` <= 0). Returns ``final``."""
    root = final.parent
    _write_atomic(root / "latest", final.name)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_in(root: Path) -> Path | None:
    """The checkpoint that ``root/latest`` names, if it is complete (has ``trainer_state.pt``), else None."""
    pointer = Path(root) / "latest"
    if pointer.exists():
        path = pointer.parent / pointer.read_text().strip()
        if (path / "trainer_state.pt").exists():
            return path
    return None


def complete_checkpoints(root: Path) -> dict[int, Path]:
    """Every complete checkpoint (one with ``trainer_state.pt``) in ``root``'s ``step-N`` folders, by step."""
    found = {}
    for path in Path(root).glob("step-*"):
        step = path.name.removeprefix("step-")
        if step.isdigit() and (path / "trainer_state.pt").is_file():
            found[int(step)] = path
    return dict(sorted(found.items()))


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint under ``out`` (or ``out`` itself if it is one), else None."""
    if (out / "trainer_state.pt").exists():
        return out
    return latest_in(out / "checkpoints")


def load_trainer_state(path: Path) -> dict[str, Any]:
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state
