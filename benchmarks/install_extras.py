"""The core install against the full one: what `pip install moectl` takes, and that the core works.

Issue #43 item 5. In fresh venvs (no ``--system-site-packages``: nothing of this environment leaks
in), each with a pip cache of its own so that every package is fetched as a new user's pip would:

1. ``python -m venv VENV && VENV/bin/pip install torch==TORCH`` (the CPU wheel, as the README pins
   it), then ``VENV/bin/pip install -e REPO`` (the core) or ``-e 'REPO[all]'``; the time of each
   step, the number of packages and the size of ``site-packages`` and of torch in it (``du -sb``);
2. in the core venv: a script that loads ``tiny:olmoe``, routes it under an ``ExpertMask`` with
   ``record=True``, computes ``moectl.switch_rate`` on the trace; ``moectl inspect --tiny olmoe``
   (exit 0); ``moectl serve --tiny olmoe`` (exit 2 and one line naming the serve extra).

It downloads packages (hundreds of MB for ``[all]``), so it is a benchmark, not a test.

    python benchmarks/install_extras.py [--torch 2.13.0] [--variants core,all] [--work /tmp/install-extras]
        [--keep] [--json benchmarks/results/install_extras.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_args import fail

REPO = Path(__file__).resolve().parents[1]
SERVE_LINE = "error: moectl serve needs the serve extra: pip install 'moectl[serve]'"

CORE_SCRIPT = r"""
import json, moectl
from moectl import ExpertMask
model, tok, info = moectl.load("tiny:olmoe")
mask = ExpertMask.from_lists(info, {0: [0, 1, 2, 3]})
ids = tok(["The history of the"])["input_ids"]
with moectl.route(model, [mask], record=True) as session:
    model(ids)
chosen = session.trace.chosen[0]
print(json.dumps({
    "chosen_inside_mask": bool((chosen[chosen >= 0] < 4).all()),
    "switch_rate": moectl.switch_rate(session.trace, k_hat=4).mean,
}))
"""


def run(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[int, str, str, float]:
    """Run ``cmd``; (exit code, stdout, stderr, seconds)."""
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - start


def site_packages(venv: Path) -> Path:
    """The venv's ``site-packages`` folder."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        fail(f"{venv} has no lib/python3*/site-packages")
    return found[0]


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (``du -sb``'s figure, links not followed)."""
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def install(variant: str, work: Path, torch_version: str) -> dict:
    """A fresh venv with torch, then moectl's core (``core``) or an extra (``all``): timings and sizes."""
    venv, cache = work / f"venv-{variant}", work / f"pip-cache-{variant}"
    for path in (venv, cache):
        shutil.rmtree(path, ignore_errors=True)
    env = {**os.environ, "PIP_CACHE_DIR": str(cache), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    code, _, err, venv_s = run([sys.executable, "-m", "venv", str(venv)], env)
    if code:
        fail(f"python -m venv {venv}: {err.strip()[-400:]}")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    code, _, err, torch_s = run([*pip, f"torch=={torch_version}"], env)
    if code:
        fail(f"pip install torch=={torch_version}: {err.strip()[-400:]}")
    target = str(REPO) if variant == "core" else f"{REPO}[{variant}]"
    code, _, err, moectl_s = run([*pip, "-e", target], env)
    if code:
        fail(f"pip install -e {target}: {err.strip()[-400:]}")
    _, listed, _, _ = run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"], env)
    packages = sorted(p["name"] for p in json.loads(listed))
    size = folder_bytes(site_packages(venv))
    torch_size = folder_bytes(site_packages(venv) / "torch")
    return {
        "variant": variant, "venv": str(venv), "command": f"pip install torch=={torch_version} && pip install -e '{target}'",
        "venv_s": round(venv_s, 1), "torch_s": round(torch_s, 1), "moectl_s": round(moectl_s, 1),
        "install_s": round(torch_s + moectl_s, 1), "packages": len(packages), "package_names": packages,
        "site_packages_bytes": size, "site_packages_gib": round(size / 2**30, 2),
        "torch_bytes": torch_size, "torch_gib": round(torch_size / 2**30, 2),
    }  # fmt: skip


def core_checks(venv: Path, work: Path) -> dict:
    """The core's jobs in the core venv, and the serve verb naming its extra."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    python, moectl = str(venv / "bin" / "python"), str(venv / "bin" / "moectl")
    code, out, err, seconds = run([python, "-c", CORE_SCRIPT], env, cwd=work)
    script = {"exit": code, "seconds": round(seconds, 1), **(json.loads(out.strip().splitlines()[-1]) if code == 0 else {"stderr": err[-600:]})}
    code, out, err, seconds = run([moectl, "inspect", "--tiny", "olmoe"], env, cwd=work)
    inspect = {"exit": code, "seconds": round(seconds, 1), "self_test_pass": "PASS" in out}
    code, out, err, seconds = run([moectl, "serve", "--tiny", "olmoe"], env, cwd=work)
    serve = {"exit": code, "stderr": err.strip(), "one_line": err.strip() == SERVE_LINE}
    passed = (
        script["exit"] == 0 and script.get("chosen_inside_mask") is True and inspect["exit"] == 0 and inspect["self_test_pass"] and serve["exit"] == 2 and serve["one_line"]
    )  # fmt: skip
    return {"route_and_switch_rate": script, "inspect": inspect, "serve_without_extra": serve, "passed": passed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="2.13.0", help="The torch version both venvs install first.")
    parser.add_argument("--variants", default="core,all", help="core and/or extras (all, serve, eval, ...).")
    parser.add_argument("--work", type=Path, default=Path("/tmp/install-extras"), help="Where the venvs go.")
    parser.add_argument("--keep", action="store_true", help="Keep the venvs and pip caches afterwards.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants:
        fail("--variants names no variant")
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict = {"python": sys.version.split()[0], "torch": args.torch, "installs": []}
    for variant in variants:
        print(f"installing {variant} ...", flush=True)
        row = install(variant, args.work, args.torch)
        if variant == "core":
            row["checks"] = core_checks(Path(row["venv"]), args.work)
        results["installs"].append(row)
        print(
            f"{variant:>5}: {row['packages']} packages, site-packages {row['site_packages_gib']} GiB "
            f"(torch {row['torch_gib']} GiB), "
            f"torch {row['torch_s']} s + moectl {row['moectl_s']} s = {row['install_s']} s", flush=True,
        )  # fmt: skip
        if "checks" in row:
            print(f"       core checks: {'pass' if row['checks']['passed'] else 'FAIL'} {json.dumps(row['checks'])}")
        if not args.keep:
            shutil.rmtree(row["venv"], ignore_errors=True)
            shutil.rmtree(args.work / f"pip-cache-{variant}", ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    core = next((r for r in results["installs"] if r["variant"] == "core"), None)
    if core is not None and not core["checks"]["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
