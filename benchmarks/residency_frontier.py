"""Routing-changing policies on one chart: bytes moved per token against KL per token (issue #31.3).

TE-MoE's trade-off drawn against what the field does instead. Every policy serves the same
held-out text with ``--budgets`` experts resident per MoE layer (``moectl.offload.runtime``, host
store): the first ``--tokens`` tokens of ``--docs`` test documents of the bundled corpus sample,
taken round-robin over its domains, each fed token by token with the KV cache (teacher forcing
through one-token decoding steps, the steps on which ``reroute:TOL``, ``option:K`` and the
controllers act). Per token we record the student's next-token log-distribution and the experts
loaded (``rt.events()`` × the expert's bytes); per policy and budget the means over documents of
KL(p_plain ‖ p_policy) per token and MiB moved per token, each with a normal 95% interval over
documents (``moectl.options.evaluate.ci95``, as TE-MoE's held-out KL), and whether the point is on
the budget's Pareto frontier (no other point at most as many bytes and at most as much KL, one of
them strictly less).

- residency only: ``lru``, ``s3fifo``, ``arc`` — the model's own routing, so KL = 0 by
  construction (a check of the harness);
- ``reroute:TOL`` — swap a non-resident expert for a resident one within TOL router probability;
- ``option:K`` — the router as an option policy with k-hat experts (routing unchanged: KL = 0,
  bytes differ);
- ``controller:DIR`` — the trained TE-MoE controllers (sampled, seed 0), each on a freshly loaded
  model (their trained routers merge into it); KL is against the ORIGINAL plain model's
  distributions, as ``moectl options evaluate`` measures it against its teacher.

The reference is the plain model fed the same way (token by token, eager experts, no offload).
The runtime refuses a policy that needs more resident experts than the budget (``option:16``,
a k-hat = 16 controller at budget 8): such combinations are listed under ``skipped`` with its
reason. One warm-up document (not counted) is served first under each policy, so the cold fill
of the resident set is not charged to the first measured document.

    OMP_NUM_THREADS=1 python benchmarks/residency_frontier.py --model models/moectl-small-standard \\
        --budgets 8,16 --docs 16 --tokens 64 \\
        --json benchmarks/results/residency_frontier_moectl-small-standard.json \\
        --plot benchmarks/results/residency_frontier_moectl-small-standard.png
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from bench_args import fail
from moectl.io.atomic import write_text_atomic
from moectl.models.load import load_model
from moectl.offload.offload_config import OffloadConfig
from moectl.offload.runtime import offload
from moectl.options.evaluate import ci95
from moectl.routing import route
from moectl.routing.kv_cache import with_cache

SAMPLE = Path(__file__).resolve().parents[1] / "src" / "moectl" / "data" / "sample" / "test.jsonl.gz"
RESIDENCY_ONLY = ("lru", "s3fifo", "arc")
REROUTE = ("reroute:0.01", "reroute:0.02", "reroute:0.05", "reroute:0.1")
OPTIONS = ("option:8", "option:16")
CONTROLLERS = ("k8-eta0.02", "k8-eta0.04", "k8-eta0.32", "k8-eta0.64", "k16-eta0.02")
MIB = 2**20
LINTHRESH = 1e-4  # KL below this is drawn on the symlog axis' linear part (residency-only: 0)


def documents(tokenizer, n: int, tokens: int) -> list[tuple[str, torch.Tensor]]:
    """``n`` + 1 (domain, ids [1, ≤ tokens]) of the sample's test split, round-robin over its domains
    (sorted; within a domain in file order); documents under 2 tokens are passed over."""
    by_domain: dict[str, list[str]] = {}
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            by_domain.setdefault(row.get("domain", "all"), []).append(row["text"])
    queues = {d: iter(texts) for d, texts in sorted(by_domain.items())}
    out: list[tuple[str, torch.Tensor]] = []
    while len(out) < n + 1 and queues:
        for domain in list(queues):
            text = next(queues[domain], None)
            if text is None:
                del queues[domain]
                continue
            ids = tokenizer.encode(text)[:tokens]
            if len(ids) >= 2 and len(out) < n + 1:
                out.append((domain, torch.tensor([ids])))
    if len(out) < n + 1:
        fail(f"--docs: the sample has {len(out) - 1} usable documents (plus one warm-up), asked for {n}")
    return out


@torch.no_grad()
def feed(model, ids: torch.Tensor) -> torch.Tensor:
    """[T, V] float32 next-token log-distributions of ``ids`` [1, T], one decoding step per token."""
    cache = DynamicCache()
    out = []
    for t in range(ids.shape[1]):
        logits = model(input_ids=ids[:, t : t + 1], **with_cache(cache), use_cache=True).logits
        out.append(F.log_softmax(logits[0, -1].float(), -1))
    return torch.stack(out)


def kl_per_token(reference: torch.Tensor, student: torch.Tensor) -> float:
    """Mean over positions of KL(p_ref ‖ p_student) for [T, V] log-distributions."""
    return float((reference.exp() * (reference - student)).sum(-1).mean())


def fresh_model(path: str, dtype: str):
    try:
        model, tokenizer = load_model(path, dtype=dtype)
    except (FileNotFoundError, OSError, ValueError) as err:
        fail(f"--model: {err}")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # offloading runs the experts' own forward
    return model, tokenizer


def serve(model, docs, reference: list[torch.Tensor], budget: int, policy: str, forward: str = "eager") -> dict:
    """One policy at one budget: per document KL per token and bytes moved per token."""
    t0 = time.perf_counter()
    with offload(model, OffloadConfig(budget=budget, policy=policy, store="host", experts_forward=forward)) as rt:
        with route(model, rt.policy.routing(rt.info)):
            spans, kls = [], []
            for i, (_, ids) in enumerate(docs):
                first = rt.step + 1
                student = feed(model, ids)
                spans.append((first, rt.step))
                if i > 0:  # docs[0] is the warm-up
                    kls.append(kl_per_token(reference[i - 1], student))
        totals, events = rt.totals(), rt.events()
        name = rt.policy.name
        rerouted = getattr(rt.policy, "rerouted", None)
    if any(n != 1 for n in rt.step_tokens):
        raise RuntimeError(f"{policy}: a forward of several tokens; every step must be a decoding step")
    expert_bytes = totals["expert_bytes"]
    moved = [0] * len(docs)
    doc_of = {s: i for i, (a, b) in enumerate(spans) for s in range(a, b + 1)}
    for step, layer, _ in events:
        moved[doc_of[step]] += expert_bytes[layer]
    tokens = [ids.shape[1] for _, ids in docs]
    mib = [moved[i] / tokens[i] / MIB for i in range(1, len(docs))]
    kl, kl_half = ci95(kls)
    mib_mean, mib_half = ci95(mib)
    row = {
        "policy": policy,
        "name": name,
        "budget": budget,
        "kl_per_token": kl,
        "kl_ci95": kl_half,
        "mib_per_token": mib_mean,
        "mib_ci95": mib_half,
        "loads_per_token": sum(1 for s, _, _ in events if doc_of[s] > 0) / sum(tokens[1:]),
        "warmup_loads": sum(1 for s, _, _ in events if doc_of[s] == 0),
        "expert_bytes": expert_bytes,
        "kl_docs": kls,
        "mib_docs": mib,
        "seconds": time.perf_counter() - t0,
    }
    if rerouted is not None:
        row["rerouted"] = rerouted
    if policy.startswith(("option:", "controller:")):  # the runtime's count of option switches (TE-MoE §2.2)
        row["switches"] = totals["switches"]
    return row


def mark_frontier(rows: list[dict]) -> None:
    """Set ``frontier`` on each row: not dominated (bytes and KL) by another row of its budget."""
    for r in rows:
        r["frontier"] = not any(
            o is not r
            and o["budget"] == r["budget"]
            and o["mib_per_token"] <= r["mib_per_token"]
            and o["kl_per_token"] <= r["kl_per_token"]
            and (o["mib_per_token"] < r["mib_per_token"] or o["kl_per_token"] < r["kl_per_token"])
            for o in rows
        )


def plot(doc: dict, path: Path) -> None:
    """One panel per budget: MiB moved per token (x) against KL per token (y), 95% error bars,
    the frontier joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moectl.io.atomic import atomic_path

    rows, budgets = doc["rows"], doc["budgets"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(6.2 * len(budgets), 4.8), squeeze=False)
    colour, marker = styles(list(dict.fromkeys(r["policy"] for r in rows)))
    top = max([r["kl_per_token"] + r["kl_ci95"] for r in rows] + [LINTHRESH])
    ticks = [0.0] + [10.0**e for e in range(-4, 1) if 10.0**e <= top * 10]
    for ax, budget in zip(axes[0], budgets, strict=True):
        here = [r for r in rows if r["budget"] == budget]
        for r in here:
            ax.errorbar(r["mib_per_token"], r["kl_per_token"], xerr=r["mib_ci95"], yerr=r["kl_ci95"],
                        fmt=marker[r["policy"]], color=colour[r["policy"]], markersize=7, capsize=3,
                        markeredgecolor="black" if r["frontier"] else colour[r["policy"]])  # fmt: skip
        front = sorted((r["mib_per_token"], r["kl_per_token"]) for r in here if r["frontier"])
        if front:
            ax.plot(*zip(*front, strict=True), "k--", linewidth=1, zorder=0)
        refused = [label(k["policy"]) for k in doc.get("skipped", []) if k["budget"] == budget]
        if refused:
            ax.text(0.98, 0.55, "not served (budget below k-hat):\n" + "\n".join(refused), transform=ax.transAxes,
                    ha="right", va="center", fontsize=8, color="dimgrey")  # fmt: skip
        ax.set_yscale("symlog", linthresh=LINTHRESH)
        ax.set_yticks(ticks)
        ax.set_ylim(-LINTHRESH / 5, top * 1.5)
        ax.set_xlim(left=0)
        ax.set_xlabel("MiB of experts moved per token")
        ax.set_ylabel("KL(plain ‖ policy) per token (nats, symlog)")
        ax.set_title(f"budget {budget} of {doc['num_experts']} experts per layer", fontsize=10)
        ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D

    kinds = ("lru", "s3fifo", "arc", "reroute:", "option:", "controller:")
    seen = sorted(dict.fromkeys(r["policy"] for r in rows),
                  key=lambda p: next((i for i, k in enumerate(kinds) if p.startswith(k)), len(kinds)))  # fmt: skip
    handles = [Line2D([], [], linestyle="none", marker=marker[p], color=colour[p], markersize=7) for p in seen]
    handles.append(Line2D([], [], linestyle="--", color="black", linewidth=1))
    labels = [label(p) for p in seen] + ["Pareto frontier (black-edged points)"]
    none = "; no trained controllers for this model" if doc.get("controllers") == [] else ""
    fig.suptitle(doc["title"] + "; bars: 95% intervals over documents" + none, fontsize=10)
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png", bbox_inches="tight")
    plt.close(fig)


def styles(policies: list[str]) -> tuple[dict, dict]:
    """Colour and marker per policy, one colour family per kind: residency only (blues, squares),
    option (purples, diamonds), reroute (oranges to reds by TOL, circles), controllers (greens, triangles)."""
    import matplotlib.pyplot as plt

    families = (
        (lambda p: p in RESIDENCY_ONLY, "Blues", "s"),
        (lambda p: p.startswith("option:"), "Purples", "D"),
        (lambda p: p.startswith("reroute:"), "OrRd", "o"),
        (lambda p: p.startswith("controller:"), "Greens", "^"),
    )
    colour, marker = {}, {}
    for test, cmap, mark in families:
        members = [p for p in policies if test(p)]
        for i, p in enumerate(members):
            colour[p] = plt.get_cmap(cmap)(0.45 + 0.5 * (i + 1) / len(members))
            marker[p] = mark
    for p in policies:
        colour.setdefault(p, "grey")
        marker.setdefault(p, "o")
    return colour, marker


def label(policy: str) -> str:
    if policy.startswith("controller:"):
        return "controller " + Path(policy.removeprefix("controller:")).name.split("controller-")[-1]
    if policy.startswith("option:"):
        return policy + " (routing unchanged)"
    return policy + (" (residency only)" if policy in RESIDENCY_ONLY else "")


def policies_for(args) -> list[tuple[str, bool]]:
    """(policy spec, needs a fresh model) in chart order."""
    specs = [(p, False) for p in (*RESIDENCY_ONLY, *REROUTE, *OPTIONS)]
    if args.controllers:
        specs += [(f"controller:{c}", True) for c in args.controllers.split(",")]
    return specs


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--budgets", default="8,16", help="resident experts per MoE layer, comma-separated")
    parser.add_argument("--docs", type=int, default=16, help="measured documents (plus one warm-up)")
    parser.add_argument("--tokens", type=int, default=64, help="first tokens of each document")
    parser.add_argument(
        "--controllers", default=None,
        help="comma-separated controller folders (default: MODEL-controller-{k8-eta0.02,k8-eta0.04,k8-eta0.32,k8-eta0.64,k16-eta0.02} "
        "that exist; '' for none)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="auto",
        help="weights' dtype (default: the checkpoint's, so the bytes moved are those served); the log-softmax is float32",
    )  # fmt: skip
    parser.add_argument(
        "--experts-forward", default="eager", choices=("eager", "grouped"),
        help="offloaded experts' forward: 'eager' (default) is the plain model's own, so residency-only KL is "
        "exactly 0; 'grouped' (serve's default) rounds differently in bf16",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--replot", type=Path, default=None, help="redraw --plot from this results JSON, no model run")
    args = parser.parse_args(argv)
    if args.replot is not None:
        if args.plot is None:
            fail("--replot needs --plot (the PNG to write)")
        try:
            doc = json.loads(args.replot.read_text())
        except (OSError, ValueError) as err:
            fail(f"--replot: {err}")
        plot(doc, args.plot)
        return doc
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        fail(f"--budgets: expected comma-separated integers, got {args.budgets!r}")
    if any(b < 1 for b in budgets) or args.docs < 1 or args.tokens < 2:
        fail("--budgets must be >= 1, --docs >= 1 and --tokens >= 2")
    if args.controllers is None:
        found = [f"{args.model}-controller-{c}" for c in CONTROLLERS]
        args.controllers = ",".join(p for p in found if Path(p).is_dir())
    model, tokenizer = fresh_model(args.model, args.dtype)
    docs = documents(tokenizer, args.docs, args.tokens)
    t0 = time.perf_counter()
    reference = [feed(model, ids) for _, ids in docs[1:]]
    print(f"reference: {sum(ids.shape[1] for _, ids in docs[1:])} tokens in {time.perf_counter() - t0:.1f}s",
          flush=True)  # fmt: skip
    rows, skipped = [], []
    num_experts = None
    for budget in budgets:
        for spec, fresh in policies_for(args):
            served = fresh_model(args.model, args.dtype)[0] if fresh else model
            try:
                row = serve(served, docs, reference, budget, spec, args.experts_forward)
            except ValueError as err:  # BudgetError and the policies' own refusals
                skipped.append({"policy": spec, "budget": budget, "reason": str(err).splitlines()[0]})
                print(f"  B={budget:<3} {spec:<60} skipped: {skipped[-1]['reason']}", flush=True)
                continue
            rows.append(row)
            print(f"  B={budget:<3} {spec:<60} KL {row['kl_per_token']:.5f} ± {row['kl_ci95']:.5f}  "
                  f"MiB/token {row['mib_per_token']:.3f} ± {row['mib_ci95']:.3f}  ({row['seconds']:.0f}s)",
                  flush=True)  # fmt: skip
    mark_frontier(rows)
    from moectl.adapters.inspect import inspect

    num_experts = inspect(model).num_experts
    n_tokens = sum(ids.shape[1] for _, ids in docs[1:])
    doc = {
        "model": args.model,
        "routing": "learned weights" if not args.model.startswith(("tiny:", "shape:")) else "random weights",
        "budgets": budgets,
        "num_experts": num_experts,
        "docs": args.docs,
        "tokens": args.tokens,
        "measured_tokens": n_tokens,
        "domains": [d for d, _ in docs[1:]],
        "warmup_domain": docs[0][0],
        "text": "bundled corpus sample, test split (src/moectl/data/sample/test.jsonl.gz)",
        "store": "host",
        "experts_forward": args.experts_forward,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "expert_bytes": rows[0]["expert_bytes"] if rows else None,
        "interval": "normal 95% over documents (moectl.options.evaluate.ci95)",
        "controllers": [c for c in args.controllers.split(",") if c],
        "controller_mode": "sample, seed 0",
        "title": f"{Path(args.model).name}: {args.docs} docs × ≤{args.tokens} tokens, teacher-forced decoding",
        "rows": rows,
        "skipped": skipped,
        "frontier": {str(b): [r["policy"] for r in rows if r["budget"] == b and r["frontier"]] for b in budgets},
    }
    for b in budgets:
        print(f"frontier at budget {b}: {', '.join(doc['frontier'][str(b)])}")
    if args.json:
        write_text_atomic(args.json, json.dumps(doc, indent=2) + "\n")
    if args.plot:
        plot(doc, args.plot)
    return doc


if __name__ == "__main__":
    main()
