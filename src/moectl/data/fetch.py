"""Fetch and unpack source packages into a cache folder, skipping whatever is already there.

Layout of the cache::

    cache/deb/PKG_VERSION_ARCH.deb          apt-get download (no installation, no dependencies)
    cache/pypi/NAME-VERSION-….whl           pip download --no-deps
    cache/unpacked/deb/PKG/                 dpkg-deb -x
    cache/unpacked/pypi/NAME-VERSION/       unzip of the wheel

An unpacked folder is complete when it holds a ``.complete`` marker; unpacking happens in a
temporary folder that is renamed at the end, so an interrupted build never leaves half a tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from moectl.data.sources import Source
from moectl.errors import MoectlError

__all__ = ["FetchError", "fetch_source", "package_version"]

_MARKER = ".complete"


class FetchError(MoectlError, RuntimeError):
    """A package could not be downloaded or unpacked."""


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise FetchError(f"{cmd[0]} is not available on this machine: {exc}") from exc
    except subprocess.CalledProcessError as exc:
        err = exc.stderr.decode(errors="replace").strip().splitlines()
        raise FetchError(f"{' '.join(cmd)} failed: {err[-1] if err else exc}") from exc


def _deb_file(package: str, cache: Path) -> Path:
    folder = cache / "deb"
    folder.mkdir(parents=True, exist_ok=True)
    found = sorted(folder.glob(f"{package}_*.deb"))
    if not found:
        _run(["apt-get", "download", package], cwd=folder)
        found = sorted(folder.glob(f"{package}_*.deb"))
        if not found:
            raise FetchError(f"apt-get download {package} produced no .deb file")
    return found[-1]


def _find_wheel(folder: Path, stem: str, version: str) -> Path | None:
    prefix = f"{stem}-{version}-" if version else f"{stem}-"
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[-1] if found else None


def _wheel_file(requirement: str, cache: Path) -> Path:
    folder = cache / "pypi"
    folder.mkdir(parents=True, exist_ok=True)
    name, _, version = requirement.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    wheel = _find_wheel(folder, stem, version)
    if wheel is None:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
              "-d", str(folder), requirement], cwd=folder)
        wheel = _find_wheel(folder, stem, version)
        if wheel is None:
            raise FetchError(f"pip download {requirement} produced no wheel")
    return wheel


def _unpack(archive: Path, target: Path, deb: bool) -> Path:
    if (target / _MARKER).exists():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if deb:
        _run(["dpkg-deb", "-x", str(archive), str(tmp)], cwd=tmp)
    else:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
    (tmp / _MARKER).write_text(archive.name + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def package_version(archive_name: str) -> str:
    """Version in a ``.deb`` or wheel file name (``pkg_1%3a1.2-3_all.deb`` → ``1:1.2-3``)."""
    parts = archive_name.split("_") if archive_name.endswith(".deb") else archive_name.split("-")
    return parts[1].replace("%3a", ":") if len(parts) > 1 else ""


def fetch_source(source: Source, cache_dir: Path) -> list[tuple[Path, str]]:
    """Download and unpack the packages of ``source``; return ``(root folder, version)`` per package.

    Local sources return their folder (``{stdlib}`` expanded) with the Python version as version.
    """
    cache_dir = Path(cache_dir).resolve()
    roots: list[tuple[Path, str]] = []
    for package in source.packages:
        if source.kind == "local":
            path = Path(package.replace("{stdlib}", sysconfig.get_paths()["stdlib"])).expanduser()
            if not path.is_dir():
                raise FetchError(f"local source folder {path} does not exist")
            version = sys.version.split()[0] if "{stdlib}" in package else ""
            roots.append((path, version))
        elif source.kind == "deb":
            deb = _deb_file(package, cache_dir)
            roots.append((_unpack(deb, cache_dir / "unpacked" / "deb" / package, deb=True), package_version(deb.name)))
        elif source.kind == "pypi":
            wheel = _wheel_file(package, cache_dir)
            target = cache_dir / "unpacked" / "pypi" / wheel.name.removesuffix(".whl")
            roots.append((_unpack(wheel, target, deb=False), package_version(wheel.name)))
        else:  # pragma: no cover - guarded by the Source type
            raise FetchError(f"unknown source kind {source.kind!r}")
    return roots
