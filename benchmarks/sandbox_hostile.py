"""The code-execution sandbox: hostile programs tried/contained, and the cost per program.

Runs moectl.eval.sandbox_check's hostile programs through the sandbox that scores HumanEval/MBPP
(counts; a breach is named), then times ``--repeats`` runs of a small HumanEval-style program in
each containment mode that works here, against a bare ``python -I program.py`` subprocess (what the
previous sandbox started; its ``setrlimit`` calls cost microseconds):

    python benchmarks/sandbox_hostile.py --repeats 20 --json benchmarks/results/sandbox_hostile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_args import fail
from moectl.eval import sandbox
from moectl.eval.code_exec import run_program
from moectl.eval.sandbox_check import HOSTILE, probe

PROGRAM = (
    "def add(a: int, b: int) -> int:\n    return a + b\n\n"
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n\ncheck(add)\n"
)


def _bare(repeats: int) -> list[float]:
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "program.py").write_text(PROGRAM)
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-I", "program.py"], cwd=tmp, check=True, stdout=subprocess.DEVNULL
            )
            times.append(time.perf_counter() - start)
    return times


def _sandboxed(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run_program(PROGRAM, allow=True)
        times.append(time.perf_counter() - start)
        assert result.passed, result.stderr
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hostile", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        fail(f"--repeats must be at least 1, got {args.repeats}")
    known = [h.name for h in HOSTILE]
    names = None if args.hostile is None else [n.strip() for n in args.hostile.split(",")]
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        fail(f"--hostile: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    sandbox.containment.cache_clear()
    how = sandbox.containment()
    report = probe(names)
    print(f"containment: {how.mode}{' (' + how.missing + ')' if how.missing else ''}")
    print(
        f"hostile programs: {report.tried} tried, {report.contained} contained, {len(report.skipped)} skipped"
    )
    for name, found in report.breaches.items():
        print(f"  NOT contained: {name}: {'; '.join(found)}")
    for name, why in report.skipped.items():
        print(f"  skipped: {name}: {why}")
    timings = {"bare python -I": _bare(args.repeats)}
    modes = ["namespace", "basic"] if how.mode == "namespace" else ["basic"]
    for mode in modes:
        sandbox.containment.cache_clear()
        os.environ[sandbox.MODE_VAR] = mode
        try:
            timings[f"sandbox ({mode})"] = _sandboxed(args.repeats)
        finally:
            os.environ.pop(sandbox.MODE_VAR, None)
            sandbox.containment.cache_clear()
    per_program = {name: statistics.median(t) for name, t in timings.items()}
    for name, median in per_program.items():
        print(f"{name:>20}: {1000 * median:7.1f} ms per program (median of {args.repeats})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "containment": how.mode,
            "tried": report.tried,
            "contained": report.contained,
            "skipped": report.skipped,
            "breaches": report.breaches,
            "seconds_per_hostile_program": report.seconds,
            "median_seconds_per_program": per_program,
            "repeats": args.repeats,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
