"""Reading experts straight from a checkpoint's shards: GB/s and page-cache growth per read method.

Issues 13/18 (serve a model larger than RAM under a memory cap): the page cache is charged to a
memory cgroup like any other memory, so reading experts must not leave them cached. This writes
a full-width ``shape:olmoe-1b-7b@2`` checkpoint (1.7 GB, released per-expert layout) under
``--dir``, then for each read method of ``moectl.io.range_read`` (``direct``: O_DIRECT
through an aligned bounce buffer; ``fadvise``: preadv + POSIX_FADV_DONTNEED; ``plain``: preadv)
reads the same random distinct (MoE layer, expert) pairs into a preallocated slot with
``ShardReader.read_expert``; rounds of every method in turn (a new draw per round, so that
no method always goes first after the checkpoint was written), each from a cold cache. Prints:

- GB/s (payload bytes / seconds spent in ``read_expert``; median and per round), ms per expert;
- page-cache growth, at its peak (sampled after every read) and at the end: from the cgroup's
  ``memory.stat`` when run under ``../shared/tools/memcap`` (else ``/proc/meminfo`` Cached, which
  other processes move too), and the checkpoint's own pages left in the cache (``mincore``:
  exact whatever else runs).

Every read is checked against the first method's (CRC-32 of the slot). Experts are distinct
within a round: what a store serves are misses of the resident set, and a cache hit would
measure the cache, not the method. The checkpoint is deleted at the end (unless ``--checkpoint`` names an existing one).

    ../shared/tools/memcap 3G -- python benchmarks/shard_read.py [--reads 96] [--rounds 3] [--json out/shard_read.json]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

from moectl.io.page_cache import evict, file_cached_bytes, page_cache_bytes
from moectl.io.range_read import DEFAULT_READ_METHOD, READ_METHODS
from moectl.io.shards import ShardReader
from moectl.models.lazy import checkpoint_reader
from moectl.models.shapes import make_checkpoint

MB = 2**20


def _crc(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for t in tensors.values():
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def run_method(reader: ShardReader, draws: list[tuple[int, int]]) -> tuple[dict, list[int]]:
    """Read ``draws`` with ``reader`` from a cold cache; figures and a checksum per read."""
    slots = [reader.empty_expert(layer.index) for layer in reader.layers]
    for file in reader.index.files:
        evict(file)
    cache0, source = page_cache_bytes()
    before = reader.stats.bytes
    peak = 0
    seconds = 0.0
    crcs = []
    for layer, expert in draws:
        t0 = time.perf_counter()
        reader.read_expert(layer, expert, out=slots[layer])
        seconds += time.perf_counter() - t0
        peak = max(peak, page_cache_bytes()[0] - cache0)
        crcs.append(_crc(slots[layer]))
    end = page_cache_bytes()[0] - cache0
    payload = reader.stats.bytes - before
    return {
        "gb_per_s": payload / seconds / 1e9,
        "ms_per_expert": 1e3 * seconds / len(draws),
        "peak": peak,
        "end": end,
        "source": source,
        "files_cached": sum(file_cached_bytes(f) for f in reader.index.files),
    }, crcs


def summarize(method: str, reader: ShardReader, rounds: list[dict], same: bool) -> dict:
    """One method's figures over the rounds: median speed, worst page-cache growth."""
    speeds = sorted(r["gb_per_s"] for r in rounds)
    return {
        "method": method,
        "method_used": "/".join(sorted({reader.io.method_for(f) for f in reader.index.files})),
        "gb_per_s_median": round(statistics.median(speeds), 3),
        "gb_per_s_rounds": [round(r["gb_per_s"], 3) for r in rounds],
        "ms_per_expert_median": round(statistics.median(r["ms_per_expert"] for r in rounds), 2),
        "page_cache_growth_peak_mb": round(max(r["peak"] for r in rounds) / MB, 1),
        "page_cache_growth_end_mb": round(rounds[-1]["end"] / MB, 1),
        "page_cache_source": rounds[0]["source"],
        "checkpoint_pages_cached_mb": round(rounds[-1]["files_cached"] / MB, 1),
        "file_bytes_per_payload_byte": round(reader.stats.file_bytes / reader.stats.bytes, 4),
        "same_bytes_as_first": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default="shape:olmoe-1b-7b@2")
    parser.add_argument("--checkpoint", type=Path, help="an existing checkpoint folder to read (kept)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write it")
    parser.add_argument("--reads", type=int, default=96, help="distinct experts read per round and method")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(READ_METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    made = None
    if args.checkpoint is None:
        made = Path(tempfile.mkdtemp(prefix="moectl-shard-read-", dir=args.dir))
        path = made / "checkpoint"
        t0 = time.perf_counter()
        summary = make_checkpoint(args.spec, path)
        print(
            f"wrote {args.spec}: {summary['bytes'] / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s at {path}"
        )
    else:
        path = args.checkpoint
    try:
        readers = {m: checkpoint_reader(path, method=m) for m in methods}
        probe = readers[methods[0]]
        pairs = [(layer.index, e) for layer in probe.layers for e in range(layer.num_experts)]
        expert_mb = probe.layers[0].expert_bytes / MB
        checkpoint_bytes = sum(f.stat().st_size for f in probe.index.files)
        reads = min(args.reads, len(pairs))
        print(
            f"{args.rounds} rounds x {reads} distinct random experts of {expert_mb:.1f} MiB each, every "
            f"method from a cold cache in turn, the same experts per round"
        )
        per_method: dict[str, list[dict]] = {m: [] for m in methods}
        same = dict.fromkeys(methods, True)
        for round_ in range(args.rounds):
            draws = random.Random(args.seed + round_).sample(pairs, reads)
            reference = None
            for method in methods:
                figures, crcs = run_method(readers[method], draws)
                reference = reference or crcs
                same[method] &= crcs == reference
                per_method[method].append(figures)
        results = [summarize(m, readers[m], per_method[m], same[m]) for m in methods]
        for r in results:
            print(
                f"  {r['method']:8s} ({r['method_used']}): {r['gb_per_s_median']:5.2f} GB/s median "
                f"{r['gb_per_s_rounds']}, {r['ms_per_expert_median']:5.1f} ms/expert; page cache "
                f"{r['page_cache_growth_peak_mb']:+.0f} MiB at peak, {r['page_cache_growth_end_mb']:+.0f} MiB at "
                f"end; checkpoint pages cached {r['checkpoint_pages_cached_mb']:.0f} MiB; bytes match: "
                f"{r['same_bytes_as_first']}"
            )
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"  page cache from: {results[0]['page_cache_source']}; max RSS {rss:.0f} MiB; default: {DEFAULT_READ_METHOD}"
        )
        for reader in readers.values():
            reader.close()
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            report = {
                "spec": args.spec,
                "checkpoint_bytes": checkpoint_bytes,
                "expert_mib": round(expert_mb, 2),
                "reads_per_round": reads,
                "rounds": args.rounds,
                "seed": args.seed,
                "max_rss_mb": round(rss, 1),
                "default_method": DEFAULT_READ_METHOD,
                "methods": results,
            }
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


if __name__ == "__main__":
    main()
