"""Crash consistency of moectl's writers: kill the process at every step of a write, check what is left.

As SQLite's crash tests and PyTorch's distributed-checkpoint tests do: each writer runs in a forked
child with ``MOECTL_CRASH_AFTER=N``, which SIGKILLs it at the N-th step of an atomic write
(``moectl.io.atomic.crash_point``: written, synced, renamed, old folder exchanged, pointer written,
old checkpoint pruned, ...), for N = 1 .. the steps an uninterrupted write takes. After each kill:

- the destination reads as the old state or the new one, never anything between (for checkpoints:
  what ``latest`` resolves to; for folders and files: every file's bytes, temporaries aside);
- the source is byte for byte what it was;
- for training runs, resuming gives what an uninterrupted run gives, bit for bit (weights, and
  every logged figure but wall-clock timings).

A kill loses nothing the page cache holds, so these runs check ordering and atomicity; the fsyncs
that make the same hold across a power cut are checked separately (tests/test_train_run_faults.py).

    python benchmarks/crash_sweep.py --json benchmarks/results/crash_sweep.json          # every point
    python benchmarks/crash_sweep.py --writers subset-export gguf --max-points 4          # a sample

Prints one row per writer: steps, crash points tried, how many left damage (the goal: 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import fail
from crash_writers import WRITERS, Writer, files_of


# -- the sweep ---------------------------------------------------------------------------------------
def in_child(folder: Path, action: Callable[[], None], env: dict[str, str]) -> str:
    """Run ``action`` in a forked child inside ``folder`` with ``env`` set: 'done', 'killed' or 'failed: ...'."""
    import torch

    import moectl.io.atomic as atomic

    sys.stdout.flush()
    sys.stderr.flush()
    # GNU OpenMP cannot run a parallel region in a forked child once the parent's thread pool has
    # run (the child waits on threads it does not have): fork with one thread, which runs inline
    threads, pid = torch.get_num_threads(), -1
    torch.set_num_threads(1)
    try:
        pid = os.fork()
    finally:
        if pid != 0:
            torch.set_num_threads(threads)
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.chdir(folder)
            os.environ.update(env)
            atomic._crash_steps = 0
            random.seed(0)  # Python reseeds `random` in a forked child: every child the same state
            warnings.simplefilter("ignore")
            action()
        except BaseException as err:  # any failure: reported to the parent through the exit code
            (folder / ".child-error").write_text(f"{type(err).__name__}: {err}")
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "done"
    error = folder / ".child-error"
    return "failed: " + (error.read_text() if error.exists() else f"status {status}")


def points(steps: int, limit: int | None) -> list[int]:
    """Crash points 1..steps, or ``limit`` of them spread evenly (the first and last included)."""
    if limit is None or limit >= steps:
        return list(range(1, steps + 1))
    if limit <= 1:
        return [steps]
    return sorted({round(1 + i * (steps - 1) / (limit - 1)) for i in range(limit)})


def sweep(writer: Writer, scratch: Path, limit: int | None = None) -> dict[str, Any]:
    """Every (or ``limit``) crash point of ``writer``: the damage found at each."""
    start = time.perf_counter()
    template = scratch / f"{writer.name}-template"
    template.mkdir(parents=True)
    here = Path.cwd()
    os.chdir(template)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the setup's own notes (e.g. a small evaluation set)
            writer.setup()
    finally:
        os.chdir(here)
    for stale in template.rglob(".child-error"):
        stale.unlink()

    def fresh(name: str) -> Path:
        folder = scratch / f"{writer.name}-{name}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(template, folder, symlinks=True)
        return folder

    def observe(folder: Path, what: Callable[[], Any]) -> Any:
        os.chdir(folder)
        try:
            return what()
        finally:
            os.chdir(here)

    old = observe(template, writer.view)
    source = {p: observe(template, lambda p=p: files_of(Path("."), [p])) for p in writer.source}
    reference = fresh("reference")
    log = reference / ".crash-log"
    status = in_child(reference, writer.write, {"MOECTL_CRASH_LOG": str(log)})
    if status != "done":
        raise RuntimeError(f"{writer.name}: the uninterrupted write {status}")
    steps = len(log.read_text().splitlines()) if log.exists() else 0
    new = observe(reference, writer.view)
    expected = observe(reference, writer.result) if writer.result else None
    damage = []
    tried = points(steps, limit)
    for n in tried:
        folder = fresh(f"crash-{n}")
        status = in_child(folder, writer.write, {"MOECTL_CRASH_AFTER": str(n)})
        problems = [] if status == "killed" else [f"not killed at step {n}: {status}"]
        seen = observe(folder, writer.view)
        if writer.per_file:
            problems += [f"{k} is neither old nor new" for k in set(seen) | set(new) | set(old)
                         if seen.get(k) not in (old.get(k), new.get(k))]  # fmt: skip
        elif seen not in (old, new):
            changed = sorted(
                k for k in set(seen) | set(new) if seen.get(k) != new.get(k) and seen.get(k) != old.get(k)
            )
            problems.append(
                f"destination neither old nor new: {changed[:4] or sorted(set(seen) ^ set(old))[:4]}"
            )
        for path, digest in source.items():
            if observe(folder, lambda p=path: files_of(Path("."), [p])) != digest:
                problems.append(f"source {path} modified")
        if writer.resume is not None:
            status = in_child(folder, writer.resume, {})
            if status != "done":
                problems.append(f"resume {status}")
            elif observe(folder, writer.result) != expected:
                problems.append("resumed run differs from the uninterrupted one")
        if problems:
            damage.append({"point": n, "problems": problems})
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return {
        "steps": steps,
        "tried": len(tried),
        "damaged": len(damage),
        "damage": damage,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--writers", nargs="+", default=list(WRITERS), help=f"Of: {', '.join(WRITERS)}.")
    parser.add_argument(
        "--max-points", type=int, default=None, help="Crash points per writer (default: all)."
    )
    parser.add_argument("--json", type=Path, default=None, help="Write the results here.")
    parser.add_argument(
        "--keep", action="store_true", help="Keep the scratch folders (damaged ones always kept)."
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.writers) - set(WRITERS))
    if unknown:
        fail(f"--writers: unknown {', '.join(unknown)}; known: {', '.join(WRITERS)}")
    if args.max_points is not None and args.max_points < 1:
        fail(f"--max-points must be at least 1, got {args.max_points}")
    if not hasattr(os, "fork"):
        fail("the crash sweep forks its writers: it runs on Linux or macOS")
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)  # forked children of a multi-threaded parent can deadlock
    hf_logging.disable_progress_bar()
    scratch = Path(tempfile.mkdtemp(prefix="moectl-crash-"))
    results: dict[str, Any] = {}
    print(f"{'writer':<22}{'steps':>6}{'tried':>7}{'damaged':>9}{'seconds':>9}")
    for name in args.writers:
        results[name] = row = sweep(WRITERS[name](), scratch, args.max_points)
        print(f"{name:<22}{row['steps']:>6}{row['tried']:>7}{row['damaged']:>9}{row['seconds']:>9}")
        for bad in row["damage"]:
            print(f"  step {bad['point']}: {'; '.join(bad['problems'])}")
    summary = {
        "tried": sum(r["tried"] for r in results.values()),
        "damaged": sum(r["damaged"] for r in results.values()),
        "writers": results,
        "scratch": str(scratch),
    }
    print(f"{summary['tried']} crash points tried, {summary['damaged']} left damage")
    if not args.keep and not summary["damaged"]:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        from moectl.io.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
