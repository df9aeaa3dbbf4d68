"""``moectl offload simulate`` on a reference model's learned routing: record, then replay.

Takes the first ``--chars`` characters of the first ``--docs`` documents of the bundled corpus
sample (``src/moectl/data/sample/test.jsonl.gz``) as prompts, records the model's routing while it
generates ``--max-new-tokens`` greedy tokens each (``moectl switch-rate --trace``), and replays that
trace through every policy at ``--budget`` (``moectl offload simulate``, expert bytes from the
checkpoint), writing the table, the JSON and the hit-rate plot:

    OMP_NUM_THREADS=1 python benchmarks/residency_reference.py --model models/moectl-small-standard \
        --routing "learned: moectl-small-standard" --out /tmp/residency-standard
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from moectl.cli import app

SAMPLE = Path(__file__).resolve().parents[1] / "src" / "moectl" / "data" / "sample" / "test.jsonl.gz"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--docs", type=int, default=48)
    parser.add_argument("--chars", type=int, default=400)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", default="4,8,16")
    parser.add_argument(
        "--routing", required=True, help="learned or random weights, for the table (e.g. 'learned: MODEL')"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for prompts, trace, JSON and plot")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"][: args.chars] for _, line in zip(range(args.docs), f, strict=False)]
    prompts = args.out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    trace = args.out / "trace"
    app(["switch-rate", args.model, "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens),
         "--temperature", "0", "--trace", str(trace)], standalone_mode=False)  # fmt: skip
    routing = f"{args.routing}; {len(texts)} corpus-sample prompts, {args.max_new_tokens} greedy tokens"
    simulate = ["offload", "simulate", str(trace.with_suffix(".safetensors")), "--budget", args.budget,
                "--routing", routing, "--json", str(args.out / "simulate.json"), "--plot", str(args.out / "hit_rate.png")]  # fmt: skip
    if (Path(args.model) / "config.json").is_file():
        simulate += ["--checkpoint", args.model]
    app(simulate, standalone_mode=False)
    return json.loads((args.out / "simulate.json").read_text())


if __name__ == "__main__":
    main()
