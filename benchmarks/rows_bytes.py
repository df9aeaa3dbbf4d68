"""How many weight bytes a decoding step of 1 and of N rows reads: the ceiling of N rows' gain (#39).

A step reads every dense weight once (attention, router, shared expert, LM head) and each expert
that any of its rows chose at each MoE layer once. With N rows the rows choose overlapping but
different experts, so a step of N rows reads more than one row's step; where both are bound by
the weights' read speed, N rows' tokens/s can reach at most N x (one row's bytes / N rows' bytes)
of one row's. This decodes ``--tokens`` greedy tokens for ``--rows`` prompts through the compiled
step and counts the distinct experts each step's rows chose per layer (from the step's own
choices), then prints both steps' bytes and that ceiling.

    python benchmarks/rows_bytes.py --json benchmarks/results/rows_bytes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import PROMPTS, fail
from compiled_step_products import active_bytes
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.io.atomic import write_text_atomic
from moectl.lm.compiled_decode import CompiledDecode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    if args.rows < 2 or args.tokens < 2:
        fail("--rows and --tokens must be >= 2")
    model, tok, _ = moectl.load(args.model)
    engine = Engine(model, tok, EngineConfig(max_batch=args.rows, compile_decode=True)).open()
    step = engine.runner.compiled
    if not isinstance(step, CompiledDecode):
        engine.close()
        fail(f"{args.model}: no compiled step ({engine.runner.path})")
    counts: list[list[int]] = []
    step.guards = True  # every step through ``_fn``, the guarded graph, to count it
    run = step._fn

    def counted(*a, **k):
        result = run(*a, **k)  # (logits, chosen [L, B, k], greedy, omega)
        if result[1].shape[1] == args.rows:  # distinct experts per layer this step
            counts.append([int(torch.unique(layer).numel()) for layer in result[1]])
        return result

    step._fn = counted
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.rows)]
    try:
        engine.generate(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0))
    finally:
        engine.close()
    if not counts:
        fail("no step ran all rows together")
    w = step.weights
    experts = [layer for layer in w.layers if layer.gate_up is not None]
    expert = sum(t.numel() * t.element_size() for t in (experts[0].gate_up[0], experts[0].down[0]))
    one = active_bytes(w)  # one row: every dense weight and top-k experts per MoE layer
    dense = one - len(experts) * w.top_k * expert
    per_layer = [statistics.mean(c) for c in zip(*counts, strict=True)]
    many = dense + sum(per_layer) * expert
    ceiling = args.rows * one / many
    print(f"{args.model}: {len(counts)} steps of {args.rows} rows; distinct experts per MoE layer "
          f"{[round(x, 1) for x in per_layer]} of {w.num_experts} (top-{w.top_k})")  # fmt: skip
    print(f"bytes a step reads: 1 row {one / 1e6:.2f} MB, {args.rows} rows {many / 1e6:.2f} MB ({many / one:.2f}x); "
          f"{args.rows} rows' tokens/s at one row's read speed: at most {ceiling:.2f}x one row's")  # fmt: skip
    if args.json_path is not None:
        result = {"model": args.model, "rows": args.rows, "steps": len(counts), "distinct_experts": per_layer,
                  "num_experts": w.num_experts, "top_k": w.top_k, "dense_bytes": dense, "expert_bytes": expert,
                  "one_row_bytes": one, "rows_bytes": many, "ceiling_vs_one_row": ceiling}  # fmt: skip
        write_text_atomic(args.json_path, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
