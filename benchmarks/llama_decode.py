"""Decode greedily with llama.cpp (llama-cpp-python) and print what ``offload_capped.py`` compares.

Run alone or under a memory cap: ``python benchmarks/llama_decode.py --gguf F.gguf --tokens 16
--json out.json``. Reports decode tokens/s (after the first token), time to first token, peak RSS
(``ru_maxrss``) and bytes this process read from storage (``/proc/self/io``), as moectl's
``serve-offload`` does. ``--no-mmap`` loads the whole file into memory; ``--n-cpu-moe`` is not
needed on a CPU-only build (every tensor is in host memory already: mmap is llama.cpp's offload).
Needs the optional extra: ``pip install llama-cpp-python`` (builds llama.cpp from source).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path


def _read_bytes() -> int | None:
    """``/proc/self/io`` read_bytes, as ``moectl.server.offload_batch`` reads it. Not imported from there on
    purpose: ``import moectl`` loads torch, whose ~0.3 GB would count against llama.cpp's cap."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default="The history of the city begins with")
    ap.add_argument("--no-mmap", action="store_true")
    ap.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="extra CPU buffer types off (Q8_0 / Q4_K_M die of SIGILL here without)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        from llama_cpp import Llama
    except ImportError:
        print("error: llama-cpp-python is not installed (pip install 'moectl[llama]')", file=sys.stderr)
        return 2
    io0 = _read_bytes()
    t0 = time.perf_counter()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from contextlib import nullcontext

    from llama_bufts import no_extra_bufts

    with no_extra_bufts() if args.no_extra_bufts else nullcontext():
        llm = Llama(
            model_path=str(args.gguf),
            n_ctx=256,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            use_mmap=not args.no_mmap,
            logits_all=False,
            verbose=False,
        )
    load_s = time.perf_counter() - t0
    tokens = llm.tokenize(args.prompt.encode())
    times = []
    start = time.perf_counter()
    for _, _token in zip(range(args.tokens), llm.generate(tokens, temp=0.0, top_k=1), strict=False):
        times.append(time.perf_counter())
    io1 = _read_bytes()
    head = {"system": "llama.cpp", "gguf": str(args.gguf), "mmap": not args.no_mmap, "threads": args.threads,
            "prompt_tokens": len(tokens)}  # fmt: skip
    report(head, times, start, load_s, io0, io1, args.json)
    return 0


def report(
    head: dict, times: list[float], start: float, load_s: float, io0, io1, json_path: Path | None
) -> dict:
    """The figures ``offload_capped.py`` compares, after ``head``: printed and written to ``json_path``.
    ``times``: when each token arrived; ``start``: when the request went in."""
    wall, decode = times[-1] - start, times[-1] - times[0]
    result = {
        **head,
        "generated_tokens": len(times),
        "load_s": load_s,
        "time_to_first_token_s": times[0] - start,
        "decode_tokens_per_s": (len(times) - 1) / decode if decode > 0 else None,
        "tokens_per_s": len(times) / wall if wall > 0 else None,  # prefill included, as moectl's
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "disk_read_bytes": None if io0 is None or io1 is None else io1 - io0,
    }
    if result["disk_read_bytes"] is not None:
        result["disk_read_bytes_per_token"] = result["disk_read_bytes"] / max(len(times), 1)
    print(json.dumps(result, indent=1))
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    raise SystemExit(main())
