"""How many experts per layer 8 decoding rows read together, for serve_load's repeated and unique prompts.

With random weights the continuations of ``serve_load --unique-prompts``'s numbered prompts converge,
so their rows route alike; this counts, per decoding step and MoE layer, the union of the experts
the 8 rows chose (the engine records each request's routing), for both prompt sets.

    python benchmarks/serve_union_prompts.py --model ckpt/olmoe --tokenizer models/moectl-small-standard
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import PROMPTS, fail
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.models.load import tokenizer_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.tokens < 2 or args.threads < 1:
        fail("--tokens must be at least 2 and --threads at least 1")
    torch.set_num_threads(args.threads)
    try:
        model, tok, info = moectl.load(args.model)
        if args.tokenizer:
            tok = tokenizer_for(args.tokenizer, int(model.config.vocab_size))
    except (ValueError, OSError) as err:
        fail(f"--model / --tokenizer: {err}")
    engine = Engine(model, tok, EngineConfig(max_batch=8, record=True))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    sets = {
        "repeated": [PROMPTS[i % len(PROMPTS)] for i in range(8)],
        "unique": [f"Request {i}. {PROMPTS[i % len(PROMPTS)]}" for i in range(8)],
    }
    for name, prompts in sets.items():
        done = engine.generate(prompts, params)
        unions = []
        for layer in range(info.num_moe_layers):
            per = [d.trace.chosen[layer][0, d.prompt_tokens :, :] for d in done]  # generated tokens, [T, k]
            for t in range(min(p.shape[0] for p in per)):
                unions.append(len(set(torch.cat([p[t] for p in per]).tolist())))
        texts = len({d.text for d in done})
        print(f"{name}: {texts}/8 distinct texts; union of the 8 rows' experts per layer and step: "
              f"{sum(unions) / len(unions):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
