"""Memory at real widths: each verb's core on two-layer, full-width slices of real MoE shapes, vs its floor.

Rows (``scale_rows.py``), per shape: eval perplexity and log-likelihood scoring at T tokens; RoE
scoring (clean cache, span path) and RoE generation at K = 1 and K = 16; ``subset select`` with
router, easy-ep and reconstruction; greedy generation recording a routing trace; generation under
an untrained option controller. Each row runs in a fresh subprocess (``--one``) on the shape's
seeded random bf16 weights (``moectl.models.shapes``; written once as a checkpoint under
``--cache`` and loaded into anonymous memory, so no file-backed page counts as resident) and
reports:

- **peak tensor bytes**: weights + the peak of live tensor storage bytes during the row, counted
  op by op (``moectl.metrics.memory.TensorMemory``, exact to the byte for every storage an ATen op
  returns; kernel-internal scratch space is not seen);
- **peak RSS**: the kernel's resident-set high-water mark (``VmHWM``), reset after loading; the
  ratio uses peak RSS minus the process's resident set before the model was loaded (interpreter,
  torch, transformers);
- **floor**: weights + KV cache + one decoder layer's activations at the row's T, computed from
  the config (formula: ``scale_floor.py``).

Goals: every row ≤ 1.5 × its floor (both measures); RoE K = 16 ≤ 1.2 × K = 1 at the same T.

    OMP_NUM_THREADS=1 python benchmarks/scale.py [--shapes olmoe-1b-7b@2,qwen3-30b-a3b@2,gpt-oss-20b@2]
        [--rows perplexity,scoring,...] [--tokens 2048] [--roe-tokens 1024] [--json out/scale.json [--merge]]
    OMP_NUM_THREADS=1 python benchmarks/scale.py --one roe-score-k16 --shape qwen3-30b-a3b@2   # one row, here

With ``--json``, the file is rewritten (atomically) after every row; ``--merge --skip-measured``
resumes a stopped run, skipping the rows the file already holds at the same sizes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale_rows import ROWS  # noqa: E402

SHAPES = ("olmoe-1b-7b@2", "qwen3-30b-a3b@2", "gpt-oss-20b@2")
SIZES = {  # option -> (default, help)
    "tokens": (2048, "T of perplexity, scoring and subset calibration"),
    "continuation": (256, "scored tokens of the scoring row"),
    "roe_tokens": (2048, "T of the RoE scoring rows"),
    "prompt": (512, "prompt tokens of RoE and controller generation"),
    "new": (32, "generated tokens of RoE and controller generation"),
    "trace_prompt": (16, "prompt tokens of the trace row"),
    "trace_new": (512, "generated tokens recorded in the trace row"),
    "sample": (64, "reconstruction's token sample per layer (max_tokens)"),
}
GIB = 2**30
# One thread; glibc's mmap threshold fixed at 64 KiB, so a freed buffer goes back to the kernel
# (by default the threshold rises to 32 MiB after the first large free and freed buffers below it
# stay in the heap, which peak RSS would count as if they were live).
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "MALLOC_MMAP_THRESHOLD_": "65536"}
GOAL_FLOOR, GOAL_ROE = 1.5, 1.2
MARK = "SCALE-ROW "


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    return {key: int(getattr(args, key)) for key in SIZES}


def _size_flags(sizes: dict[str, int]) -> list[str]:
    return [item for key, value in sizes.items() for item in (f"--{key.replace('_', '-')}", str(value))]


# -- one row, in this process -----------------------------------------------------------------
def _checkpoint(shape: str, cache: Path) -> Path:
    from moectl.models.shapes import MARKER, write_shape_checkpoint

    path = cache / shape
    if not (path / MARKER).is_file():
        write_shape_checkpoint(f"shape:{shape}", path)
    return path


def _load_resident(path: Path):
    """The checkpoint's model with every tensor copied into anonymous memory (no mmap left)."""
    import torch

    from moectl.models.load import load_model

    model, tokenizer = load_model(str(path))
    with torch.no_grad():
        for module in model.modules():
            for param in list(module.parameters(recurse=False)):
                param.data = param.data.clone()
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer is not None:
                    module._buffers[name] = buffer.clone()
    gc.collect()
    return model, tokenizer


def _weight_bytes(model) -> int:
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def run_one(row_name: str, shape: str, sizes: dict[str, int], cache: Path) -> dict:
    import torch

    from moectl.adapters.inspect import inspect
    from moectl.io.peak_rss import peak_rss, reset_peak_rss, rss
    from moectl.metrics.memory import TensorMemory
    from scale_floor import floor

    torch.set_num_threads(1)
    row = ROWS[row_name]
    path = _checkpoint(shape, cache)
    base_rss = rss()
    model, tokenizer = _load_resident(path)
    info = inspect(model)
    weights = _weight_bytes(model)
    tokens, kv_tokens = row.tokens(sizes)
    fl = floor(model.config, tokens, kv_tokens)
    gc.collect()
    reset = reset_peak_rss()
    start = time.perf_counter()
    with torch.no_grad(), TensorMemory(baseline=weights) as mem:
        produced = row.run(model, tokenizer, info, sizes)
    seconds = time.perf_counter() - start
    peak = peak_rss()
    return {
        "shape": shape,
        "row": row_name,
        "what": row.what,
        "tokens": tokens,
        "kv_tokens": kv_tokens,
        "floor": fl.as_dict(),
        "weights_measured": weights,
        "peak_tensor_bytes": mem.peak,
        "largest_tensor_bytes": mem.largest,
        "peak_rss": peak,
        "base_rss": base_rss,
        "rss_reset": reset,
        "tensor_ratio": mem.peak / fl.total,
        "rss_ratio": (peak - base_rss) / fl.total,
        "seconds": seconds,
        "ops": mem.ops,
        "result": produced,
    }


# -- the table, one subprocess per row ----------------------------------------------------------
def _available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _command(row: str, shape: str, sizes: dict[str, int], cache: Path) -> list[str]:
    return [sys.executable, str(Path(__file__)), "--one", row, "--shape", shape, "--cache", str(cache),
            *_size_flags(sizes)]  # fmt: skip


def _reproduce(command: list[str]) -> str:
    shown = ["python", os.path.relpath(command[1]), *command[2:]]
    return " ".join(f"{k}={v}" for k, v in CHILD_ENV.items()) + " " + shlex.join(shown)


def run_all(args: argparse.Namespace) -> list[dict]:
    from moectl.models.shapes import build_shape
    from scale_floor import floor

    sizes, cache = _sizes(args), Path(args.cache)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    env = {**os.environ, **CHILD_ENV}
    results: list[dict] = []
    measured = _measured(args) if args.skip_measured else set()
    total, done, t0 = len(rows) * len(shapes), 0, time.perf_counter()
    for shape in shapes:
        if all((shape, row) in measured for row in rows):
            done += len(rows)
            print(f"[scale] {shape}: every row already in {args.json}", flush=True)
            continue
        print(f"[scale] {shape}: writing the checkpoint once (cache {cache})", flush=True)
        _checkpoint(shape, cache)
        config = build_shape(f"shape:{shape}", device="meta").config
        for row in rows:
            done += 1
            if (shape, row) in measured:
                print(f"[{done}/{total}] {shape} {row}: already in {args.json}", flush=True)
                continue
            command = _command(row, shape, sizes, cache)
            entry = {"shape": shape, "row": row, "command": _reproduce(command)}
            need = floor(config, *ROWS[row].tokens(sizes)).total * 1.6 + GIB // 2
            if _available() - need < args.headroom * GIB:
                entry["skipped"] = f"needs ~{need / GIB:.1f} GiB, {_available() / GIB:.1f} GiB available"
                print(f"[{done}/{total}] {shape} {row}: skipped ({entry['skipped']})", flush=True)
                results.append(entry)
                continue
            print(f"[{done}/{total}] {shape} {row} ... ({time.perf_counter() - t0:.0f} s so far)", flush=True)
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
            if proc.returncode != 0 or not lines:
                entry["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                print(f"    failed: {entry['error'][0]}", flush=True)
            else:
                entry.update(json.loads(lines[-1][len(MARK) :]))
                print("    " + _line(entry), flush=True)
            results.append(entry)
            if args.json:  # after every row: an interrupted run keeps what it measured
                _save(args, _merged(args, list(results)))
    _roe_ratios(results)
    return results


def _measured(args: argparse.Namespace) -> set[tuple[str, str]]:
    """(shape, row) pairs ``--json`` already holds measured at this run's sizes."""
    if not (args.json and args.json.exists()):
        return set()
    data = json.loads(args.json.read_text())
    if data.get("sizes") != _sizes(args):
        return set()
    return {(r["shape"], r["row"]) for r in data["rows"] if "peak_rss" in r}


def _merged(args: argparse.Namespace, results: list[dict]) -> list[dict]:
    """With ``--merge``: ``--json``'s other rows kept, the rows run now replacing theirs."""
    if not (args.merge and args.json and args.json.exists()):
        return results
    fresh = {(r["shape"], r["row"]) for r in results}
    kept = [r for r in json.loads(args.json.read_text())["rows"] if (r["shape"], r["row"]) not in fresh]
    order = {(s.strip(), r): i for i, (s, r) in enumerate((s, r) for s in SHAPES for r in ROWS)}
    results = sorted(kept + results, key=lambda r: order.get((r["shape"], r["row"]), len(order)))
    _roe_ratios(results)
    return results


def _save(args: argparse.Namespace, results: list[dict]) -> None:
    """Write ``--json`` atomically (a temporary file renamed over it)."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_name(args.json.name + ".tmp")
    tmp.write_text(json.dumps({"sizes": _sizes(args), "rows": results}, indent=2))
    os.replace(tmp, args.json)


def _roe_ratios(results: list[dict]) -> None:
    """K = 16 rows: their peaks over the K = 1 row's of the same shape and T."""
    by = {(r["shape"], r["row"]): r for r in results if "peak_rss" in r}
    for (shape, name), r in by.items():
        if "-k16" in name and (shape, name.replace("-k16", "-k1")) in by:
            one = by[(shape, name.replace("-k16", "-k1"))]
            r["vs_k1_tensor"] = r["peak_tensor_bytes"] / one["peak_tensor_bytes"]
            r["vs_k1_rss"] = (r["peak_rss"] - r["base_rss"]) / max(1, one["peak_rss"] - one["base_rss"])


def _line(r: dict) -> str:
    return (
        f"floor {r['floor']['total'] / GIB:.2f} GiB | tensors {r['peak_tensor_bytes'] / GIB:.2f} GiB "
        f"({r['tensor_ratio']:.2f}x) | RSS {r['peak_rss'] / GIB:.2f} GiB ({r['rss_ratio']:.2f}x) | "
        f"largest {r['largest_tensor_bytes'] / 2**20:.0f} MiB | {r['seconds']:.1f} s"
    )


def _verdict(r: dict) -> str:
    if "peak_rss" not in r:
        return r.get("skipped") or f"error: {r.get('error')}"
    ok = r["tensor_ratio"] <= GOAL_FLOOR and r["rss_ratio"] <= GOAL_FLOOR
    if "vs_k1_tensor" in r:
        ok = ok and r["vs_k1_tensor"] <= GOAL_ROE and r["vs_k1_rss"] <= GOAL_ROE
    return "meets" if ok else "MISSES"


def print_table(results: list[dict]) -> None:
    header = (
        "shape",
        "row",
        "T",
        "floor GiB",
        "tensors GiB",
        "x floor",
        "RSS GiB",
        "x floor",
        "K16/K1",
        "s",
        "goal",
    )
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        if "peak_rss" not in r:
            print(f"| {r['shape']} | {r['row']} | | | | | | | | | {_verdict(r)} |")
            continue
        k1 = f"{r['vs_k1_tensor']:.2f} / {r['vs_k1_rss']:.2f}" if "vs_k1_tensor" in r else ""
        cells = (
            r["shape"], r["row"], str(r["tokens"]), f"{r['floor']['total'] / GIB:.2f}",
            f"{r['peak_tensor_bytes'] / GIB:.2f}", f"{r['tensor_ratio']:.2f}", f"{r['peak_rss'] / GIB:.2f}",
            f"{r['rss_ratio']:.2f}", k1, f"{r['seconds']:.0f}", _verdict(r),
        )  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print("\nreproduce a row:")
    for r in results:
        print(f"  {r['command']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default=",".join(r for r in ROWS if "-full-" not in r))
    parser.add_argument(
        "--cache", default="/tmp/moectl-scale", help="where the shapes' checkpoints are written"
    )
    parser.add_argument("--headroom", type=float, default=2.0, help="GiB of MemAvailable a row must leave")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--merge", action="store_true", help="keep --json's other rows, replace the rows run now"
    )
    parser.add_argument(
        "--skip-measured",
        action="store_true",
        help="with --json FILE --merge: skip the rows FILE already holds at these sizes (resume a stopped run)",
    )
    parser.add_argument("--one", help="run this row here and print its JSON (what each subprocess does)")
    parser.add_argument("--shape", help="with --one: the shape")
    for key, (default, text) in SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=default, help=text)
    args = parser.parse_args()
    if args.one:
        print(MARK + json.dumps(run_one(args.one, args.shape, _sizes(args), Path(args.cache))), flush=True)
        return
    if args.skip_measured and not (args.json and args.merge):
        raise SystemExit("--skip-measured resumes into a results file: give --json FILE --merge")
    results = _merged(args, run_all(args))
    print_table(results)
    if args.json:
        _save(args, results)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
