"""8 RoE requests of one routing through ``Engine.generate`` (how ``moectl serve`` runs them): tokens/s
per round. RoE requests of one routing share one K-sample ensemble (``engine/roe_rows.py``); to
compare with a version of moectl that ran one ensemble per request, run the script under each
(``PYTHONPATH=OLD/src``), alternating.

    python benchmarks/engine_roe_batch.py --k 8 --new 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.roe import RoEConfig

PROMPTS = ["The history of the city of", "def f(x):", "2 + 2 = 4, and 3 + 3 = 6, and so on", "a",
           "Photosynthesis converts", "Mixture of experts models route each token",
           "Once upon a time there was", "The capital of France is"]  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:olmoe")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=8, help="RoE samples per token")
    ap.add_argument("--new", type=int, default=32, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, info = moectl.load(args.model, device=args.device, dtype=args.dtype)
    config = RoEConfig(K=args.k, tau=0.3, seed=0)
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)

    def run() -> float:
        engine = Engine(model, tok, EngineConfig(max_batch=8), routings={"roe": config}, info=info)
        start = time.perf_counter()
        out = engine.generate(PROMPTS, params, "roe")
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return sum(len(c.token_ids) for c in out) / (time.perf_counter() - start)

    run()  # warm-up
    rates = [run() for _ in range(args.rounds)]
    result = {"moectl": moectl.__file__, "load_average": os.getloadavg()[0], "tokens_per_s": rates}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
