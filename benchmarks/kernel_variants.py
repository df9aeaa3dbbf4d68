"""Shared pieces of the benchmarks that time builds of one C kernel against each other (variants by
``-D`` flags, ``kernel_build.build``): the command line, and the GB/s table printed and written."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench_args import fail, int_list
from moectl.io.atomic import write_text_atomic


def parse(description: str) -> tuple[argparse.Namespace, list[int]]:
    """``--threads``, ``--megabytes`` (distinct weights per shape), ``--repeats``, ``--json``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--megabytes", type=int, default=96, help="distinct weights per shape (past the L3 cache)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    threads = int_list(args.threads, "--threads")
    if args.megabytes < 1 or args.repeats < 1 or min(threads) < 1:
        fail("--megabytes, --repeats and --threads must be >= 1")
    return args, threads


def report(gbs: dict[tuple[str, int, str], list[float]], before: str, title: str, args: argparse.Namespace,
           extra: dict | None = None) -> list[dict]:  # fmt: skip
    """Print each (shape, threads, way)'s median GB/s and its ratio to ``before``'s; write them with ``--json``."""
    load = os.getloadavg()
    print(f"{title}, weights from memory ({args.megabytes} MB a shape), load {load[0]:.1f}")
    rows = []
    for (shape, count_threads, name), values in gbs.items():
        base = statistics.median(gbs[(shape, count_threads, before)])
        rows.append({"shape": shape, "threads": count_threads, "way": name, "gb_s": statistics.median(values),
                     "vs_before": statistics.median(values) / base, "runs": values})  # fmt: skip
        print(f"{shape:<28} {count_threads} thread(s)  {name:<36} {rows[-1]['gb_s']:>6.1f} GB/s "
              f"{rows[-1]['vs_before']:>5.2f}x")  # fmt: skip
    if args.json_path is not None:
        result = {"loadavg": load, "megabytes": args.megabytes, **(extra or {}), "rows": rows}
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return rows
