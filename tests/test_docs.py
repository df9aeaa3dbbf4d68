"""The documentation site: every ```python block of docs/ runs, and the site builds without a warning.

Each page's python blocks run in order in one fresh namespace (a page's later blocks may use what its
earlier ones defined) in a fresh temporary folder, as tests/test_readme.py runs the README's.
``text``/``bash`` blocks are not run: they show commands for files or machines a test does not have.
The build runs ``sphinx-build -W`` in a subprocess (a clean Sphinx state, and the time bounded).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
BUILD_SECONDS = 90


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p)]


def test_docs_pages_have_python_blocks():
    names = {p.relative_to(DOCS).as_posix() for p in PAGES_WITH_CODE}
    for page in ("get-started.md", "guides/routing.md", "guides/subsets.md", "guides/roe.md",
                 "guides/controllers.md", "guides/switch-rate.md", "contributing.md"):
        assert page in names, f"docs/{page} lost its python examples"


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_docs_page_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for index, block in enumerate(python_blocks(page), 1):
        code = compile(block, f"{page.relative_to(DOCS.parent)} python block {index}", "exec")
        exec(code, namespace)


def test_docs_build_without_warnings(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_SECONDS, env=env)
    assert run.returncode == 0, f"sphinx-build -W failed:\n{run.stderr[-4000:]}"
    for page in ("index", "get-started", "guides/roe", "cli", "api"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MyST (``myst_heading_anchors``) both write it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_links_into_docs_resolve():
    readme = DOCS.parent / "README.md"
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme.read_text())
    assert len(links) >= 10
    for target, anchor in links:
        page = DOCS.parent / target
        assert page.is_file(), f"README links to {target}, which does not exist"
        if anchor:
            text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no '#' comments in code
            anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
            assert anchor in anchors, f"README links to {target}#{anchor}; the page has {sorted(anchors)}"
