"""TE-MoE Fig. 5 for several runs at once: reward, switch rate and KL to the teacher against the step.

Reads each run folder's ``log.jsonl`` (``moectl options train`` appends one row per step, also
while it runs) and draws one PNG, a column per curve and a colour per run: the raw values faint,
their running mean over a sliding window of 20 steps, and a bootstrap 95% band for that mean
(1000 resamples with replacement within the window, 2.5th–97.5th percentiles), as Fig. 5 does.

The log has no separate KL field: its ``reward`` is the mean of r_t = log p_teacher(a_t) −
log π(a_t) over the rollout's tokens (eq. 6), so the KL panel is −reward, the per-token reverse
KL(π ‖ p_teacher) estimated on tokens drawn from p_mix = (1 − τ)π + τ p_teacher (deviation: a
mixed-sample estimate, not an on-policy one; the log records nothing closer). The fourth panel is
the teacher's perplexity of the sampled tokens (``teacher_ppl``; §5: "perplexity also decreases").

    python benchmarks/options_curves.py --runs runs/options/std-k8-eta0.02 runs/options/std-k16-eta0.02 \\
        --out benchmarks/results/reference/options_curves.png --json benchmarks/results/reference/options_curves.json

``--json`` writes, per run, the steps logged and the windowed means (with their bootstrap 95%
intervals) of the first and last ``--window`` steps.

A thin command line: reading, smoothing, summarising and drawing are :mod:`moectl.reporting.option_curves`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moectl.reporting.option_curves import WINDOW, plot, read_log, summarise


def _short(names: list[str]) -> list[str]:
    """The folder names without their common prefix up to a ``-`` (legend labels: ``k8-eta0.02``
    rather than ``moectl-small-standard-controller-k8-eta0.02``); unchanged for a single run."""
    if len(names) < 2:
        return names
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    cut = prefix.rfind("-") + 1
    return [name[cut:] for name in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, nargs="+", required=True, help="run folders holding log.jsonl")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--json", type=Path, default=None, help="also write the per-run summary here")
    ap.add_argument(
        "--window", type=int, default=WINDOW, help="sliding window of the running mean (Fig. 5: 20)"
    )
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        if args.window < 1:
            raise ValueError(f"--window must be >= 1, got {args.window}")
        if args.out.suffix.lower() != ".png":
            raise ValueError(f"--out must name a .png file, got {args.out}")
        names = [run.name for run in args.runs]
        if len(set(names)) != len(names):
            raise ValueError(
                f"--runs: two runs share a folder name ({', '.join(names)}); the legend needs each once"
            )
        runs = dict(zip(_short(names), (read_log(run) for run in args.runs), strict=True))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plot(runs, args.out, args.window, args.title)
    summary = {"window": args.window, "runs": [summarise(n, rows, args.window) for n, rows in runs.items()]}
    for s in summary["runs"]:
        last = f"last_{min(args.window, s['steps_logged'])}"
        print(
            f"{s['run']:<22} {s['steps_logged']:>4} steps  reward {s['reward'][last]['mean']:+.3f}  "
            f"switch {s['switch_rate'][last]['mean']:.3f}  KL {s['kl'][last]['mean']:.3f}  "
            f"teacher ppl {s['teacher_ppl'][last]['mean']:.1f}  ({last.replace('_', ' ')} steps)"
        )
    print(f"wrote {args.out}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
