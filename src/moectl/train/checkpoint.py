"""Atomic checkpoints: a step folder is written beside its final name and renamed into place.

``out/checkpoints/step-000100/`` holds the model (``save_pretrained``: loads with plain
transformers), the tokenizer, and ``trainer_state.pt`` (optimizer, scheduler, step, RNG states);
``out/checkpoints/latest`` names the newest complete one. A crash mid-write leaves only a
``.tmp-*`` folder, which the next save removes; the previous checkpoint stays intact. Files and
folders are synced before they are renamed in (``moectl.io.atomic.atomic_dir``).

``trainer_state.pt`` is read with ``torch.load(weights_only=True)``: tensors and plain containers
only, so resuming a run folder someone shared cannot run code hidden in a pickle.
"""

from __future__ import annotations

import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moectl.errors import ConfigError
from moectl.io.atomic import atomic_dir, crash_point, recover_dir, write_text_atomic
from moectl.io.portable_config import make_portable


def write_dir_atomic(final: Path, write: Callable[[Path], None], overwrite: bool = True) -> Path:
    """Call ``write(tmp)`` on a fresh ``.tmp-NAME`` folder beside ``final``, then put it in place of
    ``final`` in one step (``moectl.io.atomic.atomic_dir``: synced; an old ``final`` is exchanged out).

    A crash inside ``write`` leaves only the temporary folder (removed by the next write of the same
    name); an existing ``final`` is replaced only once the new one is complete, and only with
    ``overwrite`` (else FileExistsError before anything is written). Every file gets the usual mode
    (0666 less the umask), whatever wrote it.
    """
    with atomic_dir(final, overwrite=overwrite) as tmp:
        write(tmp)
    return Path(final)


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
        make_portable(tmp)  # the config keys and tokenizer class other loaders read
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        torch.save({**state, "step": step, "rng": rng}, tmp / "trainer_state.pt")

    return commit_checkpoint(write_dir_atomic(root / f"step-{step:06d}", write), keep)


def commit_checkpoint(final: Path, keep: int = 2) -> Path:
    """Point ``latest`` (beside ``final``) at the complete checkpoint ``final``, then delete all but
    the newest ``keep`` ``step-*`` folders there (none with ``keep`` <= 0). Returns ``final``."""
    root = final.parent
    write_text_atomic(root / "latest", final.name)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
        crash_point(f"removed {old.name}")
    return final


def latest_in(root: Path) -> Path | None:
    """The checkpoint that ``root/latest`` names, if it is complete (has ``trainer_state.pt``); else,
    with a warning, the newest complete ``step-N`` folder (``latest`` written, its folder then lost or
    cut short); None when there is no complete checkpoint."""
    root = Path(root)
    pointer = root / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else ""
    if named:
        path = recover_dir(root / named)
        if (path / "trainer_state.pt").exists():
            return path
    found = complete_checkpoints(root)
    if not found:
        return None
    newest = found[max(found)]
    if named:
        warnings.warn(
            f"{pointer} names {named}, which is missing or incomplete: resuming from {newest.name}, "
            "the newest complete checkpoint",
            stacklevel=2,
        )
    return newest


def complete_checkpoints(root: Path) -> dict[int, Path]:
    """Every complete checkpoint (one with ``trainer_state.pt``) in ``root``'s ``step-N`` folders, by step."""
    found = {}
    for path in Path(root).glob("step-*") if Path(root).is_dir() else []:
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
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state


def check_nothing_to_resume(
    out: Path, fresh: str = "pass --overwrite to start the run again from step 0"
) -> None:
    """``--resume`` found no complete checkpoint: fine for a run stopped before its first one (it
    starts at step 0); a ``checkpoints/`` folder that holds something, none of it complete, is damage
    to report rather than silently train over (and delete the log of)."""
    root = out / "checkpoints"
    left = sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []
    if left:
        raise ConfigError(
            f"cannot resume {out}: no complete checkpoint in {root} (found {', '.join(left)}; a complete "
            f"one holds trainer_state.pt): {fresh}"
        )
