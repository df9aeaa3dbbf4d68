"""The README's table of memory-capped serving from one or more ``offload_capped.py`` JSON files.

Rows are grouped by cap (uncapped first, then the caps from the largest down); within a cap
llama.cpp comes first and every moectl row shows its decode tokens/s as a multiple of llama.cpp's
under the same cap (issue 18's goals are stated as such ratios):

    python benchmarks/offload_capped_report.py benchmarks/results/offload_capped_olmoe*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            active = data.get("active_weight_bytes_per_token")
            if active and row.get("decode_tokens_per_s") and "weights_gb_per_s" not in row:
                row["weights_gb_per_s"] = active * row["decode_tokens_per_s"] / 1e9
            rows.append(row)
    return rows


def _cap_key(row: dict) -> float:
    return -1.0 if row["cap_fraction"] is None else -row["cap_fraction"]


def _budget(row: dict) -> str:
    if row["system"] != "moectl":
        return "–"
    n, e = row.get("budget_experts_per_layer"), row.get("num_experts")
    if n is None or e is None:
        return str(row.get("budget"))
    n, e = (sorted(set(x)) if isinstance(x, list) else [x] for x in (n, e))
    return f"{'/'.join(map(str, n))} of {'/'.join(map(str, e))}"


def _times(ratio: float) -> str:
    return f"{ratio:.1f}×" if ratio >= 1 else f"{ratio:.2f}×"


def _label(row: dict) -> str:
    """The policy as given, a controller named by its folder's name rather than its path."""
    label = row.get("policy_label", "–")
    if label.startswith("controller:"):
        head, _, tail = label.partition(",")
        label = "controller:" + Path(head.removeprefix("controller:")).name + (f",{tail}" if tail else "")
    return label


def table(rows: list[dict]) -> str:
    """Markdown: one line per row, ratios to llama.cpp's decode tokens/s under the same cap."""
    lines = [
        "| system | policy | experts in memory | cap | decode tok/s | × llama.cpp | TTFT s | cgroup peak GiB "
        "| peak RSS GiB | disk MiB / token | hit rate | switch rate | weights GB/s |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    llama = {r["cap_fraction"]: r.get("decode_tokens_per_s") for r in rows if r["system"] == "llama.cpp"}

    def g(row: dict, key: str, scale: float = 1.0, digits: int = 2) -> str:
        v = row.get(key)
        return "–" if v is None else f"{v / scale:.{digits}f}"

    def order(row: dict) -> tuple:  # a cap's rows: llama.cpp, then moectl's by slot dtype and budget
        budget = row.get("budget_experts_per_layer") or [0]
        budget = max(budget) if isinstance(budget, list) else budget
        return (_cap_key(row), row["system"] != "llama.cpp", "int8" in row.get("policy_label", ""), budget)

    ordered = sorted(rows, key=order)
    for row in ordered:
        cap = "none" if row["cap_fraction"] is None else f"{row['cap_fraction']:.0%}"
        status = row.get("status")
        speed = g(row, "decode_tokens_per_s") if status is None else status
        base = llama.get(row["cap_fraction"])
        ratio = (
            _times(row["decode_tokens_per_s"] / base)
            if row["system"] == "moectl" and base and row.get("decode_tokens_per_s")
            else "–"
        )
        lines.append(
            f"| {row['system']} | {_label(row)} | {_budget(row)} | {cap} | {speed} | {ratio} | "
            f"{g(row, 'time_to_first_token_s', digits=1)} | {g(row, 'cgroup_peak_bytes', 2**30)} | "
            f"{g(row, 'peak_rss_bytes', 2**30)} | {g(row, 'disk_read_bytes_per_token', 2**20, 1 if (row.get('disk_read_bytes_per_token') or 0) < 10 * 2**20 else 0)} | "
            f"{g(row, 'hit_rate', digits=2)} | {g(row, 'switch_rate', digits=3)} | {g(row, 'weights_gb_per_s', digits=1)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", type=Path, help="offload_capped.py --json files")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.json if not p.is_file()]
    if missing:
        print(
            f"error: not a file: {', '.join(missing)} (give offload_capped.py --json outputs)",
            file=sys.stderr,
        )
        return 2
    print(table(load_rows(args.json)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
