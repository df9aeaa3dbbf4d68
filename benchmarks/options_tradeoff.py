"""TE-MoE's switch rate against quality over η, with the pruning baselines and the router (#44 item 1).

Reads ``benchmarks/options_headline.py`` JSON files (one per run or several runs each), keeps the
rows of one ``--k-hat`` and draws ``moectl.reporting.option_tradeoff``'s figure: controllers at
their switch rate and KL (95% intervals), joined in order of η; the four static prunings; the
router as the full model; the paper's 5-10% band. ``--json`` writes the points drawn.

    python benchmarks/options_tradeoff.py --k-hat 8 \\
        --inputs benchmarks/results/reference/options_headline_k8.json \\
                 benchmarks/results/options_eta/options_headline_k8_eta0.32.json \\
                 benchmarks/results/options_eta/options_headline_k8_eta0.64_latest.json \\
        --out benchmarks/results/options_eta/options_tradeoff_k8.png \\
        --json benchmarks/results/options_eta/options_tradeoff_k8.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import fail
from moectl.io.atomic import write_text_atomic
from moectl.reporting.option_tradeoff import plot_tradeoff, tradeoff_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=Path, nargs="+", required=True, help="options_headline.py JSON files")
    ap.add_argument("--k-hat", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True, help="the PNG")
    ap.add_argument("--title", default="")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    files = []
    for path in args.inputs:
        try:
            files.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            fail(f"--inputs {path}: not a readable JSON file ({err})")
    rows = tradeoff_rows(files, args.k_hat)
    if not rows["controllers"]:
        fail(f"no controller rows for k-hat {args.k_hat} in --inputs")
    plot_tradeoff(rows, args.k_hat, args.out, args.title)
    for c in rows["controllers"]:
        print(f"η = {c['eta']:<5g} switch {100 * c['switch']:5.1f}% ± {100 * c['switch_ci95']:.1f}  "
              f"KL {c['kl']:.3f} ± {c['kl_ci95']:.3f}" + (f"  (step {c['step']})" if c.get("step") else ""))  # fmt: skip
    print(f"wrote {args.out}")
    if args.json_path:
        write_text_atomic(args.json_path, json.dumps({"k_hat": args.k_hat, **rows}, indent=1) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
