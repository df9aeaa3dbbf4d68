"""Screenshots of the documentation site in headless Chromium, and the code blocks a reader must scroll.

    python benchmarks/docs_screenshots.py [--html DIR] [--pages index guides/serving] [--width 1280]
                                          [--out DIR] [--json FILE]

Builds the site with ``sphinx-build`` into a temporary folder (or takes ``--html``, a built site),
then for each page:

- measures it in Chromium at ``--width`` pixels: the page's height, and every code block whose text
  is wider than its box (a reader must scroll it sideways: a cut command), with the number of
  characters a code line can hold at that width;
- writes ``OUT/PAGE.png``, the whole page at that width (the window as tall as the page, at most
  ``--max-height`` pixels).

It needs Chromium (Debian: ``apt-get install chromium``; or ``--chromium PATH``), which is not a
dependency of moectl, so CI does not run this script; ``tests/test_docs.py`` keeps code lines within
the width it reports (``CODE_COLUMNS``). Exit code 1 when a code block overflows, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_args import fail

ROOT = Path(__file__).resolve().parents[1]

# Runs in the page once it has loaded; writes its findings into the DOM for --dump-dom to carry out.
MEASURE = """
<script>
window.addEventListener("load", () => {
  const probe = document.createElement("span");
  const code = document.querySelector("div.highlight pre") || document.body;
  probe.textContent = "0".repeat(100);
  probe.style.visibility = "hidden";
  code.appendChild(probe);
  const charWidth = probe.getBoundingClientRect().width / 100;
  probe.remove();
  const blocks = [];
  for (const pre of document.querySelectorAll("div.highlight pre")) {
    const first = pre.textContent.split("\\n")[0];
    blocks.push({first: first.slice(0, 100), scroll: pre.scrollWidth, client: pre.clientWidth,
                 columns: Math.floor((pre.clientWidth - 2 * parseFloat(getComputedStyle(pre).paddingLeft)) / charWidth)});
  }
  const report = {height: document.documentElement.scrollHeight, charWidth, blocks};
  const out = document.createElement("pre");
  out.id = "docs-screenshot-report";
  out.textContent = JSON.stringify(report);
  document.body.appendChild(out);
});
</script>
"""


def build(html: Path) -> None:
    cmd = [sys.executable, "-m", "sphinx", "-q", "-b", "html", str(ROOT / "docs"), str(html)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        fail(f"sphinx-build failed:\n{run.stderr[-2000:]}")


def chromium(binary: str, *args: str) -> subprocess.CompletedProcess:
    base = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--force-device-scale-factor=1", "--virtual-time-budget=3000"]  # fmt: skip
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=120)


def measure(binary: str, page: Path, width: int) -> dict:
    probe = page.with_name(page.stem + ".measure.html")
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    try:
        run = chromium(binary, f"--window-size={width},1000", "--dump-dom", probe.as_uri())
    finally:
        probe.unlink()
    start = run.stdout.find('id="docs-screenshot-report">')
    if start < 0:
        fail(f"Chromium returned no measurement for {page}:\n{run.stderr[-2000:]}")
    text = run.stdout[start + len('id="docs-screenshot-report">') :].split("</pre>", 1)[0]
    return json.loads(
        text.replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--html", type=Path, help="a built site (default: build one in a temporary folder)")
    parser.add_argument("--pages", nargs="+", default=["index", "guides/serving"])
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--max-height", type=int, default=16000)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "_build" / "screenshots")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not args.chromium:
        fail("no Chromium found: apt-get install chromium, or give --chromium PATH")
    if args.width < 320:
        fail(f"--width must be at least 320 pixels, got {args.width}")
    with tempfile.TemporaryDirectory() as tmp:
        html = args.html or Path(tmp) / "html"
        if args.html is None:
            build(html)
        args.out.mkdir(parents=True, exist_ok=True)
        results, overflowing = {}, 0
        for name in args.pages:
            page = html / f"{name}.html"
            if not page.is_file():
                fail(f"{page} does not exist (pages are named as in docs/, without .md)")
            report = measure(args.chromium, page, args.width)
            height = min(report["height"], args.max_height)
            png = args.out / f"{name.replace('/', '_')}.png"
            chromium(
                args.chromium, f"--window-size={args.width},{height}", f"--screenshot={png}", page.as_uri()
            )
            cut = [b for b in report["blocks"] if b["scroll"] > b["client"] + 1]
            overflowing += len(cut)
            columns = min((b["columns"] for b in report["blocks"]), default=None)
            results[name] = {"png": str(png), "height": report["height"], "code_blocks": len(report["blocks"]),
                             "code_columns": columns, "overflowing": cut}  # fmt: skip
            print(f"{name}: {png} ({args.width}x{height} px of {report['height']}), {len(report['blocks'])} code "
                  f"blocks, {columns} characters a code line, {len(cut)} cut")  # fmt: skip
            for block in cut:
                print(f"  cut: {block['first'][:70]!r} ({block['scroll']} px of {block['client']})")
    if args.json:
        args.json.write_text(json.dumps({"width": args.width, "pages": results}, indent=2) + "\n")
    return 1 if overflowing else 0


if __name__ == "__main__":
    sys.exit(main())
