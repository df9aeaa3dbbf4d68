"""Where an engine decode step spends its time, by part of the model, at a real model's width.

Greedy engine decoding (``moectl.engine``) of ``--model`` (default: OLMoE-1B-7B's dimensions, 4 of
its 16 layers, random bf16) at each ``--batch`` size; forward hooks time every attention module,
router (gate) and experts module, the final norm + LM head, and the rest of each decoding step
(embedding, norms, residual adds, the engine's own Python: sampling, cache bookkeeping, routing
groups) is the step's wall time minus those. Reported per decode step and per generated token,
with tokens/s per batch size: a decode step reads the same weights for every row, so batching
should raise tokens/s well above one row's.

    python benchmarks/engine_step_split.py --json benchmarks/results/engine_step_split.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import fail, int_list
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.io.atomic import write_text_atomic

PARTS = ("attention", "router", "experts", "lm_head")


class Timer:
    """Forward pre/post hooks that add each module's wall time to its part's total."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.handles: list = []
        self._start: dict[int, float] = {}

    def watch(self, module: torch.nn.Module, part: str) -> None:
        def pre(mod, args):
            self._start[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            self.totals[part] += time.perf_counter() - self._start.pop(id(mod))

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def attach(model: torch.nn.Module, info) -> Timer:
    timer = Timer()
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            timer.watch(module, "attention")
    for layer in info.layers:
        timer.watch(layer.router, "router")
        timer.watch(layer.block.experts, "experts")  # the MoE block's experts module
    timer.watch(model.get_output_embeddings(), "lm_head")
    return timer


def run(model, tok, info, batch: int, tokens: int) -> dict:
    prompts = [f"Prompt number {i}: the history of the city of" for i in range(batch)]
    engine = Engine(model, tok, EngineConfig(max_batch=batch, log_forwards=True))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    with engine:
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for rid in range(batch):  # every row prefilled, then only decoding steps are timed
            engine.submit(prompts[rid], params)
        while engine.stats()["waiting"]:
            engine.step()
        timer = attach(model, info)
        start, steps = time.perf_counter(), 0
        made = engine.counters["generated_tokens"]
        while engine.stats()["running"]:
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
        generated = engine.counters["generated_tokens"] - made
        timer.remove()
    parts = {p: timer.totals[p] / steps * 1e3 for p in PARTS}
    parts["rest"] = wall / steps * 1e3 - sum(parts.values())
    return {
        "batch": batch,
        "decode_steps": steps,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "step_ms": wall / steps * 1e3,
        "ms_per_step": parts,
        "share": {p: v / (wall / steps * 1e3) for p, v in parts.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:olmoe-1b-7b@4")
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: moectl.threads)")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    batches = int_list(args.batch, "--batch")
    if min(batches) < 1 or args.tokens < 2:
        fail("--batch sizes must be >= 1 and --tokens >= 2")
    from moectl.threads import pick_threads

    threads = pick_threads(args.threads)
    torch.set_num_threads(threads)
    model, tok, info = moectl.load(args.model, dtype="bfloat16")
    rows = [run(model, tok, info, b, args.tokens) for b in batches]
    print(f"{args.model}, bf16, {threads} threads, load average {os.getloadavg()[0]:.1f}")
    head = f"{'batch':>5} {'tok/s':>8} {'step ms':>8} " + " ".join(f"{p:>10}" for p in (*PARTS, "rest"))
    print(head + "   (ms per decode step)")
    for r in rows:
        cells = " ".join(f"{r['ms_per_step'][p]:>10.1f}" for p in (*PARTS, "rest"))
        print(f"{r['batch']:>5} {r['tokens_per_s']:>8.2f} {r['step_ms']:>8.1f} {cells}")
    one = rows[0]["tokens_per_s"]
    for r in rows:
        r["tokens_per_s_vs_batch_1"] = r["tokens_per_s"] / one
    if args.json_path is not None:
        result = {"model": args.model, "threads": threads, "loadavg": os.getloadavg(), "rows": rows}
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
