"""Where an engine decode step spends its time, by part of the model, at a real model's width.

Greedy engine decoding (``moectl.engine``) of ``--model`` (default: OLMoE-1B-7B's dimensions, 4 of
its 16 layers, random bf16) at each ``--batch`` size; forward hooks time every layer's input norm + attention + residual (a span between the two norms,
which both forwards call),
router (gate) and experts module, the final norm + LM head, and the rest of each decoding step
(embedding, norms, residual adds, the engine's own Python: sampling, cache bookkeeping, routing
groups) is the step's wall time minus those. ``--forward both`` (the default) runs each batch size through the model's own decoding forward and
moectl's lean one (``moectl.lm.lean_decode``) in one run. Reported per decode step and per generated token,
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

    def span(self, first: torch.nn.Module, after: torch.nn.Module, part: str) -> None:
        """Time from ``first``'s start to ``after``'s start (hooks on modules both forwards call)."""

        def pre(mod, args):
            self._start[id(first)] = time.perf_counter()

        def end(mod, args):
            self.totals[part] += time.perf_counter() - self._start.pop(id(first))

        self.handles += [first.register_forward_pre_hook(pre), after.register_forward_pre_hook(end)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def attach(model: torch.nn.Module, info) -> Timer:
    timer = Timer()
    for _name, module in model.named_modules():  # input norm + attention + residual: the lean forward
        if hasattr(module, "self_attn") and hasattr(module, "post_attention_layernorm"):  # calls no self_attn
            timer.span(module.input_layernorm, module.post_attention_layernorm, "attention")
    for layer in info.layers:
        timer.watch(layer.router, "router")
        timer.watch(layer.block.experts, "experts")  # the MoE block's experts module
    timer.watch(model.get_output_embeddings(), "lm_head")
    return timer


def run(model, tok, info, batch: int, tokens: int, lean: bool = True) -> dict:
    prompts = [f"Prompt number {i}: the history of the city of" for i in range(batch)]
    engine = Engine(model, tok, EngineConfig(max_batch=batch, log_forwards=True, lean_decode=lean))
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
        forward = engine.stats()["decode_forward"]
    parts = {p: timer.totals[p] / steps * 1e3 for p in PARTS}
    parts["rest"] = wall / steps * 1e3 - sum(parts.values())
    return {
        "batch": batch,
        "forward": "lean" if forward.get("lean") else "model",
        "decode_forwards": forward,
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
    ap.add_argument("--forward", choices=("lean", "model", "both"), default="both",
                    help="the decoding forward: moectl's lean one, the model's own, or both in one run")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    batches = int_list(args.batch, "--batch")
    if min(batches) < 1 or args.tokens < 2:
        fail("--batch sizes must be >= 1 and --tokens >= 2")
    from moectl.threads import pick_threads

    threads = pick_threads(args.threads)
    torch.set_num_threads(threads)
    model, tok, info = moectl.load(args.model, dtype="bfloat16")
    forwards = {"lean": [True], "model": [False], "both": [False, True]}[args.forward]
    rows = [run(model, tok, info, b, args.tokens, lean) for b in batches for lean in forwards]
    print(f"{args.model}, bf16, {threads} threads, load average {os.getloadavg()[0]:.1f}")
    head = f"{'batch':>5} {'forward':>7} {'tok/s':>8} {'step ms':>8} " + " ".join(f"{p:>10}" for p in (*PARTS, "rest"))
    print(head + "   (ms per decode step)")
    for r in rows:
        cells = " ".join(f"{r['ms_per_step'][p]:>10.1f}" for p in (*PARTS, "rest"))
        print(f"{r['batch']:>5} {r['forward']:>7} {r['tokens_per_s']:>8.2f} {r['step_ms']:>8.1f} {cells}")
    for r in rows:
        one = next(o for o in rows if o["forward"] == r["forward"])["tokens_per_s"]
        r["tokens_per_s_vs_batch_1"] = r["tokens_per_s"] / one
        model_row = next((o for o in rows if o["batch"] == r["batch"] and o["forward"] == "model"), None)
        if model_row is not None:
            r["tokens_per_s_vs_model_forward"] = r["tokens_per_s"] / model_row["tokens_per_s"]
    for r in rows:
        if r["forward"] == "lean" and "tokens_per_s_vs_model_forward" in r:
            print(f"batch {r['batch']}: lean forward {r['tokens_per_s_vs_model_forward']:.2f}x the model's own")
    if args.json_path is not None:
        result = {"model": args.model, "threads": threads, "loadavg": os.getloadavg(), "rows": rows}
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
