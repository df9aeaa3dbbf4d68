"""Time ``moectl eval``'s generation (lm-eval's ``generate_until``, ``eval.eval_generation.generate_texts``)
under each kind of routing: none, an expert mask, request-keyed Gumbel noise, Gumbel with K = 3 routed
copies per request, and RoE (K = 4 samples per token).

16 contexts × 32 greedy tokens, batch 8, on tiny OLMoE (byte vocabulary), one thread. To compare two
versions of moectl, run the script under each (``PYTHONPATH=OLD/src python benchmarks/...``),
alternating; the script uses only what both the engine-based and the earlier loop provide.

    python benchmarks/eval_generation_speed.py --repeat 3 --json eval_generation_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import moectl
from moectl import ExpertMask
from moectl.ensemble.roe_config import RoEConfig
from moectl.eval.eval_generation import GenSettings, generate_texts
from moectl.eval.eval_tokenizer import byte_tokenizer
from moectl.eval.forward import BatchRouting, static_plan
from moectl.eval.request_noise import keyed_policies
from moectl.routing.gumbel import GumbelTopK


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per routing (the median is reported)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = moectl.tiny("olmoe", vocab_size=259)
    model.set_experts_implementation("eager")
    info = moectl.inspect(model)
    tok = byte_tokenizer()
    contexts = [f"Question {i}: " + "word " * (5 + 3 * (i % 7)) + "\nAnswer:" for i in range(16)]
    copies = BatchRouting(keyed_policies([GumbelTopK(1.0, seed=3)]), repeats=3)
    plans = {
        "none": static_plan([]),
        "mask": static_plan([ExpertMask.everywhere(info, [0, 1, 2, 3])]),
        "gumbel": static_plan([GumbelTopK(1.0, seed=3)]),
        "gumbel, 3 copies": lambda batch: copies,
        "roe K=4": static_plan(roe=RoEConfig(K=4, tau=1.0, seed=5)),
    }
    rows = []
    for name, plan in plans.items():
        generate_texts(model, tok, contexts[:2], GenSettings((), 2), plan, info, 8)  # warm-up
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            texts = generate_texts(model, tok, contexts, GenSettings((), args.tokens), plan, info, 8)
            times.append(time.perf_counter() - start)
        rows.append({"routing": name, "seconds": statistics.median(times), "chars": sum(map(len, texts))})
        print(f"{name:>18}  {rows[-1]['seconds']:.3f} s  ({rows[-1]['chars']} chars)", flush=True)
    result = {"moectl": moectl.__file__, "load_average": os.getloadavg()[0], "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
