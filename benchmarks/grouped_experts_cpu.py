"""bf16 experts on the CPU: transformers' ``grouped_mm`` against moectl's padded grouped forward.

``F.grouped_mm`` in bf16 on the CPU runs one oneDNN matmul per expert, and oneDNN compiles a kernel
for every new group size; batches of varying length keep making new sizes. moectl pads each group
to a multiple of 32 rows (``moectl.models.grouped_mm.cpu_pad``) so the sizes repeat. This runs the
same forwards — ``--batches`` batches of ``--batch-size`` sequences, lengths drawn from
``--min-len``..``--max-len`` (seeded) — with each implementation in turn, ``--rounds`` times
alternating, and prints the seconds of each and their ratio, measured in one run:

    python benchmarks/grouped_experts_cpu.py --model models/moectl-small-standard \\
        --json benchmarks/results/grouped_experts_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moectl.models.grouped_experts import register


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len, (args.batches,), generator=g).tolist()
    batches = [torch.randint(3, model.config.vocab_size, (args.batch_size, n), generator=g) for n in lengths]
    implementations = {"transformers grouped_mm": "grouped_mm", "moectl padded grouped": register()}
    seconds: dict[str, list[float]] = {name: [] for name in implementations}
    for _ in range(args.rounds):
        for name, impl in implementations.items():
            model.set_experts_implementation(impl)
            start = time.perf_counter()
            with torch.no_grad():
                for ids in batches:
                    model(input_ids=ids)
            seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    base, ours = median["transformers grouped_mm"], median["moectl padded grouped"]
    for name, value in median.items():
        print(f"{name:<26}{value:>8.2f} s  (rounds: {', '.join(f'{s:.2f}' for s in seconds[name])})")
    print(f"speed-up {base / ours:.2f}x  ({args.batches} batches of {args.batch_size} × {min(lengths)}–{max(lengths)} "
          f"tokens, {torch.get_num_threads()} threads)")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"model": args.model, "lengths": lengths, "batch_size": args.batch_size,
                  "threads": torch.get_num_threads(), "seconds": seconds, "median_s": median,
                  "speedup": base / ours}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
