"""A short GPU check (a minute or two): engine decode tokens/s at OLMoE-1B-7B's dimensions, by decoding path, resident and offloaded.

Greedy engine decoding (``moectl.engine``) of ``--model`` (default: OLMoE-1B-7B's shape, all 16
layers, random weights, in ``--dtype`` bf16) on ``--device`` (default cuda) at each ``--batch`` size,
through each of ``--paths``: ``lean`` (the lean forward, one kernel launch at a time from Python),
``compiled`` (the step through ``torch.compile``, ``moectl.lm.compiled_decode``: what ``moectl serve``
decodes with on the CPU) and ``graphs`` (the step over static buffers replayed as CUDA graphs,
``moectl.lm.graph_decode``; on the CPU its uncaptured twin). Every row is prefilled first, then only decoding steps are timed (the engine
syncs with the host once per step for the sampled tokens, so the step's wall time is the device's).
Beside each step time, the read floor: the bytes of weights one step must read (every weight outside
the experts, and per MoE layer the experts the rows are expected to touch, k at one row, E(1 - (1 -
k/E)^B) at B rows under uniform routing, as random weights route) over the device's read speed
measured in the same run (the sum of a 1 GiB int64 tensor: each byte read once, nothing written,
next to no arithmetic; a copy, which also writes every byte, measured half of it on the CPU: 16
against 28.7 GB/s, and would make the floor twice too long). Then the same with the
experts offloaded (``OffloadConfig(budget=--budget, store="host")``: on CUDA the pinned host store,
async loads on a side stream and prefetch by default), with loads per token and the hit rate, and
whether each row's tokens equal the resident run's (bf16: the offloaded slot forward and the
resident experts forward may round differently, so this is reported, not required).

    python benchmarks/gpu_check.py --json $OUT/gpu_check.json
    python benchmarks/gpu_check.py --device cpu --model tiny:olmoe --tokens 8 --budget 0   # a dry run on the CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import PROMPTS, fail, int_list
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.io.atomic import write_text_atomic
from moectl.offload.offload_config import OffloadConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_speed(device: torch.device, gib: float = 1.0) -> float:
    """Bytes per second the device reads: the best of 5 sums of a ``gib`` GiB int64 tensor."""
    src = torch.ones(int(gib * (1 << 30)) // 8, dtype=torch.int64, device=device)
    src.sum()
    _sync(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        src.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return src.numel() * src.element_size() / best


def step_bytes(model, info, batch: int) -> float:
    """Weight bytes one decoding step of ``batch`` rows reads (see the module doc): everything outside
    the experts (the embedding: one row per token), and the experts expected to be touched."""
    experts = {id(p) for layer in info.layers for p in layer.block.experts.parameters()}
    embed = model.get_input_embeddings().weight
    other = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts and p is not embed)
    total = other + batch * embed[0].numel() * embed.element_size()
    for layer in info.layers:
        e, k = layer.num_experts, layer.top_k
        one = sum(p.numel() * p.element_size() for p in layer.block.experts.parameters()) / e
        total += e * (1 - (1 - k / e) ** batch) * one
    return total


def run(model, tok, device: torch.device, batch: int, tokens: int, offload: OffloadConfig | None,
        path: str = "lean") -> dict:  # fmt: skip
    """Decode ``tokens`` per row for ``batch`` rows prefilled together through ``path``; tokens/s of
    the decoding steps."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    graphs = {"lean": {}, "compiled": {"compile_decode": True, "graph_decode": False},
              "graphs": {"compile_decode": True, "graph_decode": True}}[path]  # fmt: skip
    engine = Engine(model, tok, EngineConfig(max_batch=batch, offload=offload, **graphs))
    out: dict[int, list[int]] = {}

    def on_event(e) -> None:
        out.setdefault(e.request_id, []).extend(e.token_ids)

    with engine:
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        before = engine.stats().get("offload")
        ids = [engine.submit(PROMPTS[i % len(PROMPTS)], params, on_event=on_event) for i in range(batch)]
        while engine.stats()["waiting"]:  # admitted rows are prefilled together, then only decode steps
            engine.step()
        _sync(device)
        made, steps, start = engine.counters["generated_tokens"], 0, time.perf_counter()
        while engine.stats()["running"]:
            engine.step()
            steps += 1
        _sync(device)
        wall = time.perf_counter() - start
        generated = engine.counters["generated_tokens"] - made
        after = engine.stats().get("offload")
        loader = getattr(engine.runtime, "loader_name", None) if offload is not None else None
        forward = engine.stats()["decode_forward"]
    row: dict[str, Any] = {
        "batch": batch,
        "path": path,
        "forwards": {k: v for k, v in forward.items() if k in ("compiled", "lean", "model", "slow")},
        "offload": offload is not None,
        "decode_steps": steps,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall if wall > 0 else None,
        "step_ms": wall / steps * 1e3 if steps else None,
        "tokens": [out[i] for i in ids],
    }
    if offload is not None and before is not None and after is not None:
        loads = after["loads"] - before["loads"]
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        row |= {
            "budget": offload.budget,
            "loader": loader,
            "loads_per_token": loads / generated if generated else None,
            "mb_moved_per_token": (after["bytes_moved"] - before["bytes_moved"]) / 1e6 / max(generated, 1),
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "budget_per_layer": after["budget_per_layer"],
            "resident_expert_gb": after["resident_expert_bytes"] / 1e9,
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:olmoe-1b-7b")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:1, cpu (a dry run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--paths", default="lean,graphs", help="decoding paths: lean, compiled, graphs (comma-separated)")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per row")
    ap.add_argument("--budget", type=float, default=0.25, help="offloaded runs' budget fraction; 0: none")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    batches = int_list(args.batch, "--batch")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or not set(paths) <= {"lean", "compiled", "graphs"}:
        fail(f"--paths takes lean, compiled and/or graphs, got {args.paths!r}")
    if min(batches) < 1 or args.tokens < 2:
        fail("--batch sizes must be >= 1 and --tokens >= 2")
    if not 0 <= args.budget <= 1:
        fail(f"--budget is a fraction in [0, 1] (0: no offloaded runs), got {args.budget}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("no CUDA device: give --device cpu for a dry run")
    began = time.perf_counter()
    model, tok, _ = moectl.load(args.model, dtype=args.dtype, device=args.device)
    _sync(device)
    load_s = time.perf_counter() - began
    speed = read_speed(device)
    info = moectl.inspect(model)
    rows = [run(model, tok, device, b, args.tokens, None, path) for path in paths for b in batches]
    for r in rows:
        r["read_floor_ms"] = step_bytes(model, info, r["batch"]) / speed * 1e3
        r["step_over_floor"] = r["step_ms"] / r["read_floor_ms"] if r["step_ms"] else None
    if args.budget > 0:
        offload = OffloadConfig(budget=args.budget, store="host")
        for b in batches:
            row = run(model, tok, device, b, args.tokens, offload)
            resident = next(r for r in rows if r["batch"] == b and not r["offload"] and r["path"] == "lean")
            same = [a == c for a, c in zip(row["tokens"], resident["tokens"], strict=True)]
            row["rows_equal_to_resident"] = sum(same) / len(same)
            row["tokens_per_s_vs_resident"] = row["tokens_per_s"] / resident["tokens_per_s"]
            rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    print(
        f"{args.model}, {args.dtype} on {args.device} ({name}), {args.tokens} tokens per row, load {load_s:.1f} s"
    )
    print(f"device read speed {speed / 1e9:.1f} GB/s (the read floor's)")
    print(f"{'batch':>5} {'path':>8} {'offload':>8} {'tok/s':>8} {'step ms':>8} {'floor':>6} {'x':>6} "
          f"{'loads/tok':>9} {'hit':>5} {'same':>5}")  # fmt: skip
    for r in rows:
        floor = f"{r['read_floor_ms']:.2f}" if "read_floor_ms" in r else "-"
        over = f"{r['step_over_floor']:.1f}" if r.get("step_over_floor") else "-"
        off = f"{r['budget']:g}" if r["offload"] else "-"
        loads = f"{r['loads_per_token']:.2f}" if r.get("loads_per_token") is not None else "-"
        hit = f"{r['hit_rate']:.2f}" if r.get("hit_rate") is not None else "-"
        same = f"{r['rows_equal_to_resident']:.2f}" if "rows_equal_to_resident" in r else "-"
        print(
            f"{r['batch']:>5} {r.get('path', 'lean'):>8} {off:>8} {r['tokens_per_s']:>8.1f} {r['step_ms']:>8.2f} "
            f"{floor:>6} {over:>6} {loads:>9} {hit:>5} {same:>5}"
        )
    wall = time.perf_counter() - began
    print(f"total {wall:.1f} s" + (f", peak GPU memory {peak:.2f} GB" if peak is not None else ""))
    if args.json_path is not None:
        result = {
            "model": args.model,
            "device": args.device,
            "device_name": name,
            "dtype": args.dtype,
            "torch": torch.__version__,
            "tokens_per_row": args.tokens,
            "load_s": load_s,
            "wall_s": wall,
            "peak_gpu_gb": peak,
            "read_gb_per_s": speed / 1e9,
            "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        }
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
