"""The code-execution sandbox: hostile programs tried/contained/fake passes, and the cost per program.

Runs moectl.eval.sandbox_check's programs through the sandbox that scores HumanEval/MBPP: the
containment and integrity attacks (counts: tried, contained, fake passes, i.e. wrong solutions
scored as passed; a breach is named) and the honest solutions (scored right or not), with the
memory the program of children over the bound used (cgroup peak). Then it times the per-program
cgroup setup and removal alone, and ``--repeats`` runs of a small HumanEval-style program in each
containment mode that works here (with and without the cgroup; scored whole, and with its checks
outside the program), interleaved with a bare ``python -I program.py`` subprocess and, with
``--previous``, an earlier moectl's ``run_program``:

    git show bfe2b37:src/moectl/eval/code_exec.py > /tmp/previous_code_exec.py
    python benchmarks/sandbox_hostile.py --repeats 30 --previous /tmp/previous_code_exec.py \
        --json benchmarks/results/sandbox_hostile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_args import fail
from moectl.eval import sandbox, sandbox_cgroup
from moectl.eval.sandbox_check import HOSTILE, Report, probe

SOLUTION = "def add(a: int, b: int) -> int:\n    return a + b\n"
TESTS = (
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n\ncheck(add)\n"
)
PROGRAM = f"{SOLUTION}\n{TESTS}"
FORK_PROGRAM = "children over the memory bound"


def _previous(path: Path) -> Callable[[], object]:
    """``run_program`` of an earlier ``code_exec.py`` (loaded from ``path``), on :data:`PROGRAM`."""
    spec = importlib.util.spec_from_file_location("previous_code_exec", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return lambda: module.run_program(PROGRAM, allow=True)


def _timings(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each variant, the variants interleaved (load drifts alike)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "program.py").write_text(PROGRAM)
        for _ in range(repeats):
            for name, call in variants.items():
                start = time.perf_counter()
                if call is _bare:
                    subprocess.run([sys.executable, "-I", "program.py"], cwd=tmp, check=True)
                else:
                    result = call()
                    assert getattr(result, "passed", True), result
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _bare() -> None:
    """Marker: a bare ``python -I program.py`` subprocess."""


def _sandboxed(how: sandbox.Containment, checked: bool = False) -> Callable[[], object]:
    """:data:`PROGRAM` whole, or (``checked``) :data:`SOLUTION` with :data:`TESTS` run outside it."""
    if checked:
        checks = sandbox.Checks(TESTS, names=("add",))
        return lambda: _passed(sandbox.launch(SOLUTION, 10.0, 2 * 1024**3, 16 * 1024**2, 64, how, checks))
    return lambda: _passed(sandbox.launch(PROGRAM, 10.0, 2 * 1024**3, 16 * 1024**2, 64, how))


def _passed(outcome: sandbox.Outcome) -> sandbox.Outcome:
    assert outcome.verdict == "passed", outcome
    return outcome


def _cgroup_ms(plan: sandbox_cgroup.CgroupPlan | None, repeats: int) -> float | None:
    """Median milliseconds to make one program's cgroup, read its peak and remove it (None: no cgroup)."""
    if plan is None:
        return None
    times = []
    for _ in range(max(repeats, 20)):  # cheap: at least 20 for a steady median
        start = time.perf_counter()
        with sandbox_cgroup.program_cgroup(plan, 2 * 1024**3, 64) as group:
            group.peak()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _print_report(how: sandbox.Containment, report: Report) -> None:
    print(f"containment: {how.mode}{' (' + how.missing + ')' if how.missing else ''}")
    print(f"memory bound: {how.memory_bound()}")
    print(
        f"hostile programs: {report.tried} tried, {report.contained} contained, "
        f"{len(report.fake_passes)} fake passes, {len(report.skipped)} skipped"
    )
    if report.honest_tried:
        print(f"honest programs: {report.honest_tried} tried, {report.honest_right} scored right")
    if FORK_PROGRAM in report.statuses:
        peak = report.memory_peaks.get(FORK_PROGRAM)
        used = (
            f"{peak / 1024**2:.0f} MiB at peak (cgroup)" if peak is not None else "not measured (no cgroup)"
        )
        print(f"  {FORK_PROGRAM}: {report.statuses[FORK_PROGRAM]}, {used}")
    for name, found in report.breaches.items():
        print(f"  NOT contained: {name}: {'; '.join(found)}")
    for name, why in report.skipped.items():
        print(f"  skipped: {name}: {why}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hostile", default=None, help="comma-separated names (default: all)")
    parser.add_argument(
        "--previous",
        type=Path,
        default=None,
        help="an earlier code_exec.py to time too, e.g. from "
        "`git show bfe2b37:src/moectl/eval/code_exec.py > /tmp/previous_code_exec.py`",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        fail(f"--repeats must be at least 1, got {args.repeats}")
    if args.previous is not None and not args.previous.is_file():
        fail(f"--previous: {args.previous} is not a file")
    known = [h.name for h in HOSTILE]
    names = None if args.hostile is None else [n.strip() for n in args.hostile.split(",")]
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        fail(f"--hostile: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    sandbox.containment.cache_clear()
    how = sandbox.containment()
    report = probe(names)
    _print_report(how, report)
    cgroup_ms = _cgroup_ms(how.cgroup, args.repeats)
    if cgroup_ms is not None:
        print(f"cgroup setup + removal: {cgroup_ms:.2f} ms per program (median of {max(args.repeats, 20)})")
    variants: dict[str, Callable[[], object]] = {"bare python -I": _bare}
    if args.previous is not None:
        variants["previous code_exec"] = _previous(args.previous)
    if how.mode == "namespace":
        variants["sandbox (namespace)"] = _sandboxed(how)
        variants["sandbox (namespace, checks outside)"] = _sandboxed(how, checked=True)
        if how.cgroup is not None:
            variants["sandbox (namespace, no cgroup)"] = _sandboxed(dataclasses.replace(how, cgroup=None))
    variants["sandbox (basic)"] = _sandboxed(sandbox.basic_mode("benchmark"))
    per_program = _timings(variants, args.repeats)
    for name, median in per_program.items():
        print(f"{name:>36}: {1000 * median:7.1f} ms per program (median of {args.repeats}, interleaved)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "containment": how.mode,
            "memory_bound": how.memory_bound(),
            "tried": report.tried,
            "contained": report.contained,
            "fake_passes": len(report.fake_passes),
            "fake_pass_names": report.fake_passes,
            "honest_tried": report.honest_tried,
            "honest_right": report.honest_right,
            "skipped": report.skipped,
            "breaches": report.breaches,
            "statuses": report.statuses,
            "memory_peak_bytes": report.memory_peaks,
            "cgroup_ms_per_program": cgroup_ms,
            "seconds_per_hostile_program": report.seconds,
            "median_seconds_per_program": per_program,
            "repeats": args.repeats,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
