"""The documentation site: every command on every page runs as written, and the site builds without a warning.

Each page's ```python and ```bash blocks run in order, in one fresh temporary folder per page (a
page's later blocks use the files and names its earlier ones made), as a reader would run them from
the repository root: the folder holds links to the checkout's ``models/`` and ``docs/``, so
``models/moectl-small-standard`` and ``docs/examples/math_val.jsonl`` are there.

- ``python`` blocks run in this process, in one namespace per page.
- ``bash`` blocks run with ``bash -euo pipefail``. A block whose one command is ``moectl serve ...``
  is a server: it starts in the background, the next blocks run once ``/health`` answers, and it is
  stopped at the end of the page (or when the page starts another). Every block talks to it on a
  free port: ``127.0.0.1:8000`` in the page is that port, and ``--port`` is added to the command.
- every other block (``text``, ``json``, ``jinja``, MyST directives) is output or a placeholder and
  is not run; a runnable block holds no placeholder (``test_runnable_blocks_hold_no_placeholders``).

The environment is the offline one of CI: one torch thread, the hub off, and ``$MOECTL_EVALS`` a
folder holding a few synthetic HellaSwag and HumanEval rows where ``moectl data fetch-evals`` would put the real
set, so ``moectl data fetch-evals --sets hellaswag`` finds them there and downloads nothing.
The build runs ``sphinx-build -W`` in a subprocess (a clean Sphinx state, and the time bounded).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
FENCE = re.compile(r"^```([^\s`]*)[^\n]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)
RUNNABLE = ("python", "bash")
BUILD_SECONDS = 90
BLOCK_SECONDS = 180  # one bash block; each takes seconds (the slowest: a short pretraining run)
SERVER_START_SECONDS = 120
PAGE_SECONDS = 900  # one whole page, every block
JOBS = int(os.environ.get("MOECTL_DOCS_JOBS", min(2, os.cpu_count() or 1)))  # pages run side by side
PORT = "8000"  # what the pages write; the tests serve on a free port instead


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """``(language, code, line)`` of every fenced block of ``page``, in order."""
    text = page.read_text()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def runnable(page: Path) -> list[tuple[str, str, int]]:
    return [b for b in blocks(page) if b[0] in RUNNABLE]


def python_blocks(page: Path) -> list[str]:
    return [code for lang, code, _ in blocks(page) if lang == "python"]


PAGES_WITH_CODE = [p for p in PAGES if runnable(p)]
GUIDES = sorted((DOCS / "guides").glob("*.md"))


def _name(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


def test_docs_pages_have_examples():
    names = {_name(p) for p in PAGES_WITH_CODE}
    for page in ("get-started.md", "contributing.md", *(f"guides/{g.name}" for g in GUIDES)):
        assert page in names, f"docs/{page} lost its examples"
    for page in ("guides/routing.md", "guides/subsets.md", "guides/roe.md", "guides/controllers.md"):
        assert python_blocks(DOCS / page), f"docs/{page} lost its python examples"


def test_guides_open_with_a_quick_start():
    """What the guide is for (a paragraph under the title), then ``## Quick start`` with a command."""
    for page in GUIDES:
        text = page.read_text()
        headings = re.findall(r"^## (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), flags=re.M)
        assert headings and headings[0] == "Quick start", f"{_name(page)}: first section is {headings[:1]}"
        intro = text.split("\n## ", 1)[0].split("\n", 1)[1].strip()
        assert intro and not intro.startswith("```"), f"{_name(page)}: no sentence says what it is for"
        quick = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
        assert re.search(r"^```(bash|python)$", quick, flags=re.M), (
            f"{_name(page)}: a quick start without a command"
        )


PLACEHOLDER = re.compile(
    r"<[A-Z][A-Z_-]*>|…|\b(MODEL|FILE|DIR|PATH|TRACE|SPEC|NAME|DOMAIN|SUBSET|CKPT|MODEL_DIR)\b|\[--"
)


def test_runnable_blocks_hold_no_placeholders():
    """Placeholders (``<MODEL>``, ``FILE``, ``[--flag]``, ``…``) belong in ``text`` blocks, never in runnable ones."""
    bad = []
    for page in PAGES:
        for lang, code, line in runnable(page):
            if lang == "python":
                code = "\n".join(x for x in code.splitlines() if "<" not in x)  # comparisons, generics
            for match in PLACEHOLDER.finditer(code):
                bad.append(f"{_name(page)}:{line}: {match.group(0)!r} in a {lang} block")
    assert not bad, "placeholders in runnable blocks:\n" + "\n".join(bad)


CODE_COLUMNS = 88  # what a code block shows without scrolling at 1280 px (benchmarks/docs_screenshots.py)


def test_guide_code_fits_the_page():
    """No command or output line of a guide is cut at 1280 px: lines of at most CODE_COLUMNS characters."""
    long = [
        f"{_name(page)}:{line + i + 1}: {len(text)} characters"
        for page in [*GUIDES, DOCS / "get-started.md", DOCS / "index.md"]
        for lang, code, line in blocks(page)
        if not lang.startswith("{")
        for i, text in enumerate(code.splitlines())
        if len(text) > CODE_COLUMNS
    ]
    assert not long, "code lines wider than the page:\n" + "\n".join(long)


# -- running the pages ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _seed_evals(cache: Path) -> None:
    """A few synthetic HellaSwag and HumanEval rows in the layout ``moectl data fetch-evals`` writes (no network in CI)."""
    words = ["apple", "river", "stone", "cloud", "light", "metal", "green", "sound", "paper", "water"]
    rows = []
    for i in range(12):
        w = [words[(i * 3 + j) % len(words)] for j in range(8)]
        rows.append({
            "ind": i, "activity_label": w[0].title(), "ctx_a": f"A {w[1]} lies by the {w[2]}.",
            "ctx_b": f"then the {w[3]}", "ctx": f"A {w[1]} lies by the {w[2]}. Then the {w[3]}",
            "endings": [f"{w[4 + c % 4]} falls on the {w[(c + i) % 8]}." for c in range(4)],
            "source_id": f"synthetic-{i}", "split": "val", "split_type": "indomain", "label": str(i % 4),
        })  # fmt: skip
    code = [
        {"task_id": f"HumanEval/{i}", "entry_point": name,
         "prompt": f"def {name}(a, b):\n    \"\"\"{doc}\"\"\"\n", "canonical_solution": f"    return {expr}\n",
         "test": f"def check(candidate):\n    assert candidate(2, 3) == {value}\n"}
        for i, (name, doc, expr, value) in enumerate([("add", "Add a and b.", "a + b", 5),
                                                      ("mul", "Multiply a and b.", "a * b", 6)])
    ]  # fmt: skip
    manifest: dict = {"sets": {}}
    for name, split, split_rows in (("hellaswag", "validation", rows), ("humaneval", "test", code)):
        path = cache / name / f"{split}.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in split_rows))
        manifest["sets"][name] = {
            "title": f"{name} (synthetic rows for the docs tests)", "kind": "synthetic", "license": "MIT",
            "homepage": "", "fields": list(split_rows[0]), "notes": "",
            "splits": {split: {"rows": len(split_rows), "bytes": path.stat().st_size, "sha256": "", "members": []}},
        }  # fmt: skip
    (cache / "manifest.json").write_text(json.dumps(manifest))


class _Page:
    """One page's run: its folder, environment, namespace and the server it started."""

    def __init__(self, page: Path, folder: Path) -> None:
        self.page, self.folder = page, folder
        self.port = str(_free_port())
        self.server: subprocess.Popen | None = None
        self.server_log = folder / ".server.log"
        for name in ("models", "docs"):
            (folder / name).symlink_to(ROOT / name)
        _seed_evals(folder / ".evals")
        bin_dir = str(Path(sys.executable).parent)
        self.env = {
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(folder / ".hf-datasets"),
            "TOKENIZERS_PARALLELISM": "false",
            "MPLBACKEND": "Agg",
            "MOECTL_EVALS": str(folder / ".evals"),
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        }
        self.namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}

    def where(self, lang: str, line: int) -> str:
        return f"{self.page.relative_to(ROOT)}:{line} ({lang} block)"

    def local(self, code: str) -> str:
        return code.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{self.port}").replace(
            f"localhost:{PORT}", f"localhost:{self.port}"
        )

    def run_python(self, code: str, line: int) -> None:
        exec(compile(self.local(code), self.where("python", line), "exec"), self.namespace)

    def run_bash(self, code: str, line: int) -> None:
        commands = [x for x in code.splitlines() if x.strip() and not x.lstrip().startswith("#")]
        if commands and re.match(r"moectl serve\s", commands[0]):
            return self.start_server(code, line)
        env = {**os.environ, **self.env}
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", self.local(code)], cwd=self.folder, env=env,
                             capture_output=True, text=True, timeout=BLOCK_SECONDS)  # fmt: skip
        assert run.returncode == 0, (
            f"{self.where('bash', line)} exited {run.returncode}:\n{code}\n--- stdout\n{run.stdout[-3000:]}"
            f"\n--- stderr\n{run.stderr[-3000:]}"
        )

    def start_server(self, code: str, line: int) -> None:
        self.stop_server()
        # a page's server answers its requests; compiling its decoding step (a minute on a fresh machine)
        # is tested in tests/test_compiled_decode.py and test_server_logprobs.py, not once per page
        flags = f"--port {self.port}" + ("" if "--compile" in code else " --no-compile")
        command = re.sub(r"^moectl serve\s", f"moectl serve {flags} ", code.lstrip(), count=1)
        log = self.server_log.open("w")
        self.server = subprocess.Popen(["bash", "-c", command], cwd=self.folder, env={**os.environ, **self.env},
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise AssertionError(
                    f"{self.where('bash', line)}: the server exited:\n{self.server_log.read_text()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"{self.where('bash', line)}: no /health after {SERVER_START_SECONDS} s")

    def stop_server(self) -> None:
        if self.server is None:
            return
        if self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)  # the group this test started
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        self.server = None

    def run(self) -> None:
        """Every runnable block of the page, in order, in this process (cwd and environment: the page's)."""
        os.chdir(self.folder)
        os.environ.update(self.env)
        try:
            for lang, code, line in runnable(self.page):
                start, cpu = time.monotonic(), _cpu_seconds()
                if lang == "python":
                    self.run_python(code, line)
                else:
                    self.run_bash(code, line)
                print(
                    f"{self.where(lang, line)}: {time.monotonic() - start:.1f} s, "
                    f"{_cpu_seconds() - cpu:.1f} CPU s",
                    file=sys.stderr,
                )
        finally:
            self.stop_server()


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (the bash blocks' commands)."""
    usage = os.times()
    return usage.user + usage.system + usage.children_user + usage.children_system


def _run_page(page: Path, folder: Path) -> subprocess.CompletedProcess:
    """One page in a process of its own (``python tests/test_docs.py PAGE FOLDER``): its python blocks
    change the working folder and the environment, so pages can run side by side."""
    cmd = [sys.executable, str(Path(__file__).resolve()), str(page), str(folder)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=PAGE_SECONDS)
    except subprocess.TimeoutExpired as err:
        return subprocess.CompletedProcess(
            cmd, -1, str(err.stdout or ""), f"no result after {PAGE_SECONDS} s"
        )


@pytest.fixture(scope="session")
def page_runs(request, tmp_path_factory):
    """The selected pages, run ``JOBS`` at a time from the first test that asks: {page: future}."""
    selected = [item.callspec.params["page"] for item in request.session.items
                if item.originalname == "test_docs_page_runs"]  # fmt: skip
    pool = ThreadPoolExecutor(max_workers=JOBS)
    futures = {page: pool.submit(_run_page, page, tmp_path_factory.mktemp(page.stem)) for page in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_name)
def test_docs_page_runs(page, page_runs):
    run = page_runs[page].result()
    assert run.returncode == 0, f"{_name(page)}:\n{run.stdout[-6000:]}\n{run.stderr[-6000:]}"


def test_docs_build_without_warnings(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_SECONDS, env=env)
    assert run.returncode == 0, f"sphinx-build -W failed:\n{run.stderr[-4000:]}"
    for page in ("index", "get-started", "guides/roe", "guides/serving", "cli", "api"):
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


GENERATED = ("cli.md", "api.md")  # their sections come from directives; sphinx-build -W checks those links


def test_docs_links_between_pages_resolve():
    """Every ``[text](page.md#anchor)`` between the docs' own pages names a page and a heading that exist."""
    bad = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target, anchor in re.findall(r"\]\(([^)#\s:]+\.md)(?:#([^)\s]+))?\)", text):
            dest = (page.parent / target).resolve()
            if not dest.is_file():
                bad.append(f"{_name(page)} links to {target}, which does not exist")
                continue
            if anchor and dest.name not in GENERATED:
                dest_text = re.sub(r"^```.*?^```", "", dest.read_text(), flags=re.S | re.M)
                if anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", dest_text, flags=re.M)}:
                    bad.append(f"{_name(page)} links to {target}#{anchor}, a heading it lacks")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":  # one page's run, for test_docs_page_runs: python tests/test_docs.py PAGE FOLDER
    _Page(Path(sys.argv[1]), Path(sys.argv[2])).run()
