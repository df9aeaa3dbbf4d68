"""EMO Figure 3 in miniature: held-out loss of per-domain expert subsets, standard MoE vs EMO.

For each domain of the corpus: select experts with the router method (mean routing probability,
EMO's default, §4.2) on a few validation documents, keep 100%, 50%, 25% and 12.5% of the routed
experts (the shared expert always stays), and measure held-out (test split) loss of the subset
model — routing restricted with ``ExpertMask(renorm="pruned")``, which equals the physically
exported subset — relative to the full model. EMO's claim (§5.2): ≈1% drop at 25% and ≈3% at
12.5%, while a standard MoE degrades sharply. Deviation: EMO reports accuracy drops on MMLU /
MMLU-Pro; these models are too small for those, so the figure is the relative increase of the
held-out next-token loss (first ``--max-length`` tokens of each test document).

``--methods router,reap,frequency`` adds the retention table of other selection methods of
``moectl.subsets`` (REAP, frequency, ...; issue #31.5), each chosen on the same calibration
documents: per method, model and kept fraction the mean relative increase with its interval and the
paired difference to the router selection. The figure draws the router selection only.

``--finetune`` adds EMO's "with fine-tuning" rows (Figure 3 bottom, appendix C): each subset is
sliced out (``slice_experts``, the exported checkpoint), fine-tuned on that domain's training
documents (loss on every token, AdamW, linear decay, effective batch ``--ft-batch``) for a small
budget (``--ft-docs`` documents, at most ``--ft-steps`` steps), and its held-out loss measured
again, relative to the same un-fine-tuned full model. ``--ft-fractions`` / ``--ft-domains``
restrict which subsets are fine-tuned (fine-tuning dominates the run time on a CPU).

95% intervals: every held-out document's summed loss is kept; a domain's relative increase is
Σ loss(subset) / Σ loss(full) − 1 over its documents (the token counts cancel), and the headline
is its mean over domains. The interval is a seeded percentile bootstrap over documents
(``moectl.eval.intervals.bootstrap_interval``), paired: one resample serves the full model, every
subset and both models. Deviation: documents are resampled from the pooled set rather than
within each domain (the shared helper draws one multinomial), so a domain's document count varies
between resamples; the statistic is still the mean over domains.

    python benchmarks/subset_retention.py --models models/moectl-small-standard models/moectl-small-emo \
        --corpus /work/data/corpus --json benchmarks/results/reference/subset_retention.json \
        --plot benchmarks/results/reference/subset_retention.png
    python benchmarks/subset_retention.py --models ... --fractions 1,0.25,0.125 --methods router,reap,frequency
    python benchmarks/subset_retention.py --models ... --finetune --ft-fractions 0.25,0.125 --ft-steps 20
    python benchmarks/subset_retention.py --replot RESULTS.json --plot FIG.png   # redraw, no model run
    python benchmarks/subset_retention.py --models ... --quantize int4 [--group-size 64]   # on int4 experts

``--quantize int4|int8`` (issue 40) re-measures the figure on quantized experts: subsets are chosen
(and fine-tuned) on the float32 model as loaded, its held-out losses measured, then its experts are
quantized in place (``moectl.loaded.quantize_loaded``; routers, attention and embeddings stay
float32, activations float32: PyTorch's int4 CPU kernel takes them) and every loss above is the
quantized model's, relative to the quantized full model. The JSON's ``quantization`` adds what
quantizing itself costs: the quantized full model's loss relative to the unquantized one's, and each
quantized subset's relative to the unquantized full model. A fine-tuned subset is quantized after
its fine-tuning.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench_args import fail
from moectl.adapters.inspect import inspect
from moectl.adapters.slicing import slice_experts
from moectl.data.domains import corpus_texts_by_domain
from moectl.errors import ConfigError
from moectl.eval.intervals import DEFAULT_SEED, bootstrap_interval
from moectl.io.atomic import write_text_atomic
from moectl.loaded import quantize_loaded
from moectl.models.load import load_model
from moectl.quant.quant_config import DEFAULT_GROUP_SIZE, SCHEMES, check_group_size, check_scheme
from moectl.routing import ExpertMask, route
from moectl.subsets.calibrate import tokenize
from moectl.subsets.finetune import finetune_subset
from moectl.subsets.select import METHODS, method_name, select_subset

NAMES = ("standard", "emo")
METHOD_STYLES = ((":", "s"), ("-.", "^"), ((0, (5, 1, 1, 1, 1, 1)), "D"))  # further methods: line, marker
COLOURS = {"standard": "#1b9e77", "emo": "#7b3294"}  # EMO Figure 3: green = standard MoE, purple = EMO


@torch.no_grad()
def document_losses(
    model, tokenizer, texts: Sequence[str], policies=(), max_length: int = 256, batch_size: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Summed next-token cross-entropy and predicted-token count of each text (its first
    ``max_length`` tokens, padding excluded); Σ nll / Σ tokens is ``subsets.gating.mean_loss``."""
    nll, tokens = [], []
    device = next(model.parameters()).device
    for start in range(0, len(texts), batch_size):
        batch = tokenize(tokenizer, texts[start : start + batch_size], max_length)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with route(model, list(policies)):
            logits = model(input_ids=ids, attention_mask=mask).logits
        targets = mask[:, :-1].bool() & mask[:, 1:].bool()
        loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
        nll.append((loss * targets).sum(1).double().cpu())
        tokens.append(targets.sum(1).cpu())
    return torch.cat(nll).numpy(), torch.cat(tokens).numpy()


def finetuned_nll(model, tokenizer, keep: dict, train: list[str], heldout: list[str], args) -> np.ndarray:
    """Per-document held-out loss of the subset sliced out of ``model`` and fine-tuned on ``train``
    (EMO appendix C); with ``--quantize`` the fine-tuned subset is quantized before it is measured."""
    subset = slice_experts(copy.deepcopy(model), keep)
    finetune_subset(
        subset, tokenizer, train, lr=args.ft_lr, batch_size=args.ft_batch, micro_batch_size=args.ft_micro,
        max_length=args.ft_max_length or args.max_length, max_steps=args.ft_steps, epochs=args.ft_epochs,
    )  # fmt: skip
    if getattr(args, "quantize", None):
        quantize_loaded(subset, args.quantize, group_size=args.group_size)
    return document_losses(subset, tokenizer, heldout, max_length=args.max_length)[0]


def _row(nll: np.ndarray, full: np.ndarray, tokens: np.ndarray, args) -> dict:
    """One domain's loss, relative increase and its 95% interval (bootstrap over the domain's documents)."""
    stat = relative_statistic({"d": (nll, full)})
    return {
        "loss": float(nll.sum() / tokens.sum()),
        "relative": float(nll.sum() / full.sum() - 1),
        "ci95": list(bootstrap_interval(stat, len(nll), args.iters, args.seed)),
        "nll": nll.round(4).tolist(),
    }


def choose(model, tokenizer, texts: list[str], fractions: list[float], info, args) -> dict[str, dict]:
    """Per kept fraction (``f"{fraction:g}"``): k and the experts each selection method keeps, chosen on
    the calibration ``texts`` (the router selection always; the other methods when k < N)."""
    batch = tokenize(tokenizer, texts, args.max_length)
    out = {}
    for fraction in fractions:
        k = max(info.top_k, round(info.num_experts * fraction))
        methods = [m for m in args.method_list if m == "router" or k < info.num_experts]
        with torch.no_grad():
            keep = {
                m: select_subset(model, batch["input_ids"], k, m, batch["attention_mask"], info=info)
                for m in methods
            }
        out[f"{fraction:g}"] = {"k": k, "keep": keep}
    return out


def retention(
    path: str, calib: dict, heldout: dict, train: dict | None, fractions: list[float], args
) -> tuple[dict, dict | None]:
    """``({domain: row}, quantization summary)`` of one model: the full model's loss and, per kept
    fraction, the subset's.

    Subsets are chosen (and, with ``--finetune``, fine-tuned) on the model as loaded. With
    ``--quantize`` the model's held-out losses are measured, then it is quantized in place and every
    row's loss is the quantized model's: ``full`` / ``nll_full`` are the quantized full model (the
    reference of the relative increases) and ``unquantized`` holds the unquantized full model's,
    ``quantization`` the quantized full model's loss relative to it."""
    try:
        model, tokenizer = load_model(path, dtype="float32")
    except (FileNotFoundError, OSError, ValueError) as err:
        fail(f"--models: {err}")
    info = inspect(model)
    domains = sorted(heldout)
    chosen = {d: choose(model, tokenizer, calib[d], fractions, info, args) for d in domains}
    tuned = {
        (d, key): finetuned_nll(
            model, tokenizer, chosen[d][key]["keep"]["router"], train[d], heldout[d], args
        )
        for d in domains
        if train is not None and d in train
        for key in (f"{f:g}" for f in fractions if f in args.ft_fraction_list)
    }
    unquantized, quant = {}, None
    if args.quantize:
        unquantized = {d: document_losses(model, tokenizer, heldout[d], max_length=args.max_length)[0]
                       for d in domains}  # fmt: skip
        quant = quantize_loaded(model, args.quantize, group_size=args.group_size).to_dict()
        info = inspect(model)
    results = {}
    for domain in domains:
        full, tokens = document_losses(model, tokenizer, heldout[domain], max_length=args.max_length)
        row = {"full": float(full.sum() / tokens.sum()), "documents": len(full), "tokens": tokens.tolist(),
               "nll_full": full.round(4).tolist()}  # fmt: skip
        if args.quantize:
            ref = unquantized[domain]
            stat = relative_statistic({"d": (full, ref)})
            row["unquantized"] = {"full": float(ref.sum() / tokens.sum()), "nll_full": ref.round(4).tolist()}
            row["quantization"] = {  # the quantized full model's loss relative to the unquantized one's
                "relative": float(full.sum() / ref.sum() - 1),
                "ci95": list(bootstrap_interval(stat, len(full), args.iters, args.seed)),
            }

        def nll_of(keep: dict, k: int, domain: str = domain, full: np.ndarray = full) -> np.ndarray:
            if k == info.num_experts:  # every expert kept: the pruned-renorm mask is the identity
                return full
            policy = ExpertMask.from_lists(info, keep, renorm="pruned")
            return document_losses(model, tokenizer, heldout[domain], [policy], args.max_length)[0]

        for fraction in fractions:
            key = f"{fraction:g}"
            k, keep = chosen[domain][key]["k"], chosen[domain][key]["keep"]
            row[key] = {"k": k, **_row(nll_of(keep["router"], k), full, tokens, args)}
            others = [m for m in args.method_list if m != "router"]
            if others:
                row[key]["methods"] = {
                    m: _row(full if k == info.num_experts else nll_of(keep[m], k), full, tokens, args)
                    for m in others
                }
            if (domain, key) in tuned:
                row[key]["finetuned"] = _row(tuned[domain, key], full, tokens, args)
        results[domain] = row
        line = "  ".join(f"{f:g}: {row[f'{f:g}']['relative']:+.1%}" for f in fractions)
        tuned_line = "  ".join(
            f"{f:g}: {row[f'{f:g}']['finetuned']['relative']:+.1%}"
            for f in fractions
            if "finetuned" in row[f"{f:g}"]
        )
        cost = (
            f"  ({args.quantize} vs unquantized {row['quantization']['relative']:+.2%})"
            if args.quantize
            else ""
        )
        print(f"  {Path(path).name:<24}{domain:<8} full {row['full']:.3f}{cost}  {line}"
              + (f"  | fine-tuned {tuned_line}" if tuned_line else ""), flush=True)  # fmt: skip
    return results, quant


def relative_statistic(
    groups: dict[str, tuple[np.ndarray, np.ndarray]],
) -> Callable[[np.ndarray], np.ndarray]:
    """Bootstrap statistic over the pooled documents of ``groups`` ({domain: (nll subset, nll full)},
    in order): mean over domains of Σ c·nll_subset / Σ c·nll_full − 1 (``c``: draw counts [iters, n])."""
    spans, start = [], 0
    for sub, full in groups.values():
        spans.append((slice(start, start + len(sub)), sub, full))
        start += len(sub)

    def stat(counts: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):  # a domain drawn 0 times: left out
            rel = np.stack([(counts[:, s] @ sub) / (counts[:, s] @ full) - 1 for s, sub, full in spans], 1)
        return np.nanmean(rel, 1)

    return stat


def _groups(rows: dict, key: str, field: str | None, domains: Sequence[str], method: str = "router") -> dict:
    def nll(domain: str) -> np.ndarray:
        entry = rows[domain][key]
        if method != "router":
            entry = entry["methods"][method]
        return np.asarray((entry[field] if field else entry)["nll"])

    return {d: (nll(d), np.asarray(rows[d]["nll_full"])) for d in domains}


def _difference(a: Callable, b: Callable) -> Callable[[np.ndarray], np.ndarray]:
    return lambda counts: a(counts) - b(counts)


def summarise(results: dict, fractions: list[float], args) -> dict:
    """Per model and kept fraction: the mean relative increase over domains with its 95% interval,
    without and (where measured) with fine-tuning, and the paired difference standard − EMO."""
    out: dict = {}
    domains = sorted(next(iter(results.values())))
    for fraction in fractions:
        key = f"{fraction:g}"
        entry: dict = {"fraction": fraction, "k": results[NAMES[0]][domains[0]][key]["k"]}
        for field in (None, "finetuned"):
            used = [d for d in domains if field is None or field in results[NAMES[0]][d][key]]
            if not used:
                continue
            stats = {name: relative_statistic(_groups(results[name], key, field, used)) for name in NAMES}
            n = sum(len(results[NAMES[0]][d]["nll_full"]) for d in used)
            whole = np.ones((1, n))
            block = {
                "domains": used,
                **{name: {"relative": float(stats[name](whole)[0]),
                          "ci95": list(bootstrap_interval(stats[name], n, args.iters, args.seed))}
                   for name in NAMES},
                "difference": {
                    "relative": float(stats["standard"](whole)[0] - stats["emo"](whole)[0]),
                    "ci95": list(bootstrap_interval(_difference(stats["standard"], stats["emo"]), n,
                                                    args.iters, args.seed)),
                },
            }  # fmt: skip
            if field is None:
                entry.update(block)
            else:
                # the same domains without fine-tuning, so the dashed line has its solid partner
                plain = {name: relative_statistic(_groups(results[name], key, None, used)) for name in NAMES}
                block["not_finetuned"] = {
                    name: {"relative": float(plain[name](whole)[0]),
                           "ci95": list(bootstrap_interval(plain[name], n, args.iters, args.seed))}
                    for name in NAMES
                }  # fmt: skip
                entry["finetuned"] = block
        if len(getattr(args, "method_list", ["router"])) > 1:
            entry["methods"] = method_summary(results, key, domains, args)
        out[key] = entry
    return out


def quantization_summary(results: dict, fractions: list[float], args) -> dict:
    """Per model: the quantized full model's held-out loss relative to the unquantized full model's
    (what quantizing costs), and per kept fraction the quantized router subset's relative to the
    unquantized full model (quantizing and pruning together); mean over domains, 95% intervals from
    the same paired bootstrap as the figure's."""
    domains = sorted(next(iter(results.values())))
    n = sum(len(results[NAMES[0]][d]["nll_full"]) for d in domains)
    whole = np.ones((1, n))

    def cell(name: str, nll) -> dict:
        stat = relative_statistic(
            {d: (np.asarray(nll(results[name][d])), np.asarray(results[name][d]["unquantized"]["nll_full"]))
             for d in domains}
        )  # fmt: skip
        return {
            "relative": float(stat(whole)[0]),
            "ci95": list(bootstrap_interval(stat, n, args.iters, args.seed)),
        }

    return {
        "full_model": {name: cell(name, lambda r: r["nll_full"]) for name in NAMES},
        "subsets_vs_unquantized": {
            f"{f:g}": {name: cell(name, lambda r, key=f"{f:g}": r[key]["nll"]) for name in NAMES}
            for f in fractions
        },
    }


def method_summary(results: dict, key: str, domains: list[str], args) -> dict:
    """Per selection method and model: the mean relative increase over domains with its 95% interval,
    and the paired difference to the router selection (same bootstrap resamples)."""
    n = sum(len(results[NAMES[0]][d]["nll_full"]) for d in domains)
    whole = np.ones((1, n))
    out: dict = {}
    for method in args.method_list:
        out[method] = {}
        for name in NAMES:
            stat = relative_statistic(_groups(results[name], key, None, domains, method))
            cell = {
                "relative": float(stat(whole)[0]),
                "ci95": list(bootstrap_interval(stat, n, args.iters, args.seed)),
            }
            if method != "router":
                router = relative_statistic(_groups(results[name], key, None, domains))
                diff = _difference(stat, router)
                cell["minus_router"] = {"relative": float(diff(whole)[0]),
                                        "ci95": list(bootstrap_interval(diff, n, args.iters, args.seed))}  # fmt: skip
            out[method][name] = cell
    return out


def print_methods(summary: dict, labels: dict[str, str]) -> None:
    """The retention table: relative held-out loss increase per selection method, model and kept fraction."""
    entries = [e for e in summary.values() if "methods" in e and e["fraction"] < 1]
    if not entries:
        return
    width = max(30, *(len(labels[n]) + 10 for n in NAMES))
    print(f"\n{'method':<12}{'kept':<8}{'k':>4}  " + "".join(f"{labels[n] + ' [95% CI]':<{width}}" for n in NAMES)
          + "".join(f"{labels[n] + ' − router':<{width}}" for n in NAMES))  # fmt: skip
    for method in entries[0]["methods"]:
        for e in entries:
            cells = [e["methods"][method][n] for n in NAMES]
            text = "".join(
                f"{c['relative']:+7.2%} [{c['ci95'][0]:+.2%}, {c['ci95'][1]:+.2%}]".ljust(width)
                for c in cells
            )
            diffs = "".join(
                f"{c['minus_router']['relative']:+7.2%} [{c['minus_router']['ci95'][0]:+.2%}, "
                f"{c['minus_router']['ci95'][1]:+.2%}]".ljust(width)
                if "minus_router" in c
                else "".ljust(width)
                for c in cells
            )
            print(f"{method:<12}{e['fraction']:<8.1%}{e['k']:>4}  {text}{diffs}")


def print_summary(summary: dict, field: str | None = None) -> None:
    print(
        f"{'kept':<8}{'k':>4}  {'standard [95% CI]':<28}{'EMO [95% CI]':<28}{'standard − EMO [95% CI]':<28}"
    )
    for entry in summary.values():
        block = entry.get(field) if field else entry
        if not block:
            continue
        cells = [block[name] for name in NAMES] + [block["difference"]]
        text = "".join(
            f"{c['relative']:+7.2%} [{c['ci95'][0]:+.2%}, {c['ci95'][1]:+.2%}]".ljust(28) for c in cells
        )
        print(f"{entry['fraction']:<8.1%}{entry['k']:>4}  {text}")


def plot(
    summary: dict,
    labels: dict[str, str],
    domains: list[str],
    docs: int,
    path: Path,
    ft_note: str = "",
    quant_note: str = "",
) -> None:
    """EMO Figure 3's layout: x = experts kept (100% left), y = relative loss increase; standard vs EMO,
    solid = no fine-tuning, dashed = fine-tuned, shaded = 95% interval. Fine-tuned on fewer domains
    than evaluated: a second panel compares the two on those domains only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(summary.values())
    others = [m for m in entries[0].get("methods", {}) if m != "router"] if entries else []
    tuned = [e for e in entries if "finetuned" in e]
    ft_domains = tuned[0]["finetuned"]["domains"] if tuned else []
    split = bool(tuned) and ft_domains != domains
    fig, axes = plt.subplots(
        1, 2 if split else 1, figsize=(12.5 if split else 7, 5), squeeze=False, sharey=True
    )

    def line(ax, rows: list[dict], pick, name: str, style: str, label: str, marker: str = "o") -> None:
        x = [r["fraction"] for r in rows]
        y = np.array([pick(r)[name]["relative"] for r in rows]) * 100
        lo, hi = (np.array([pick(r)[name]["ci95"][i] for r in rows]) * 100 for i in (0, 1))
        ax.plot(x, y, style, color=COLOURS[name], marker=marker, label=label, lw=2)
        ax.fill_between(x, lo, hi, color=COLOURS[name], alpha=0.15, lw=0)

    def frame(ax, title: str) -> None:
        fr = [e["fraction"] for e in entries]
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            fr,
            [
                f"{f:.1%}".replace(".0%", "%") + f"\n{e['k']} experts"
                for f, e in zip(fr, entries, strict=True)
            ],
        )
        ax.minorticks_off()
        ax.set_xlim(max(fr) * 1.15, min(fr) / 1.15)  # 100% on the left, as in EMO Figure 3
        ax.axhline(0, color="grey", lw=0.8)
        chosen = "selection method as labelled" if others else "router selection"
        ax.set_xlabel(f"routed experts kept per layer ({chosen}; shared expert always kept)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", handlelength=3.5)  # long enough to show the dashes

    ax = axes[0][0]
    for name in NAMES:
        line(
            ax, entries, lambda r: r, name, "-", f"{labels[name]}, {'router' if others else 'no fine-tuning'}"
        )
        if tuned and not split:
            line(ax, tuned, lambda r: r["finetuned"], name, "--", f"{labels[name]}, fine-tuned")
    note = f"; fine-tuned: {ft_note}" if tuned and not split and ft_note else ""
    for method, (style, mark) in zip(others, METHOD_STYLES, strict=False):
        for name in NAMES:
            line(
                ax,
                entries,
                lambda r, m=method: r["methods"][m],
                name,
                style,
                f"{labels[name]}, {method}",
                mark,
            )
    frame(ax, f"held-out loss, mean over {len(domains)} domains ({docs} test documents){note}")
    ax.set_ylabel(f"loss increase vs {quant_note + ' ' if quant_note else ''}full model (%)")
    if split:
        ax = axes[0][1]
        for name in NAMES:
            line(
                ax,
                tuned,
                lambda r: r["finetuned"]["not_finetuned"],
                name,
                "-",
                f"{labels[name]}, no fine-tuning",
            )
            line(ax, tuned, lambda r: r["finetuned"], name, "--", f"{labels[name]}, fine-tuned")
        frame(ax, f"fine-tuned domains only: {', '.join(ft_domains)}" + (f"\n({ft_note})" if ft_note else ""))
    quant = f" of the {quant_note} model" if quant_note else ""
    fig.suptitle(f"Selective expert use (EMO Fig. 3 in miniature): per-domain subsets{quant}; shaded: 95% "
                 "bootstrap interval over documents", fontsize=11)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the suptitle is wider than the axes
    plt.close(fig)


def replot(payload: dict, path: Path) -> None:
    """Draw the figure of an earlier ``--json`` file (no model is run)."""
    results = payload["results"]
    domains = sorted(results["standard"])
    docs = sum(results["standard"][d]["documents"] for d in domains)
    labels = {name: Path(p).name for name, p in zip(NAMES, payload["models"], strict=True)}
    plot(payload["summary"], labels, domains, docs, path, finetune_note(payload.get("finetune")),
         quant_note(payload.get("quantization")))  # fmt: skip


def finetune_note(settings: dict | None) -> str:
    if not settings:
        return ""
    return (f"{settings['ft_steps']} steps × {settings['ft_batch']} documents of ≤{settings['ft_max_length']} "
            f"tokens, lr {settings['ft_lr']:g}")  # fmt: skip


def quant_note(quantization: dict | None) -> str:
    if not quantization:
        return ""
    group = quantization.get("group_size")
    return quantization["scheme"] + (f" (group {group})" if group else "")


def _fractions(text: str, option: str) -> list[float]:
    try:
        values = [float(f) for f in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < f <= 1 for f in values):
        fail(f"{option} must be comma-separated fractions in (0, 1], e.g. 1,0.5,0.25,0.125; got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs=2, help="standard and EMO checkpoints, in that order")
    parser.add_argument("--corpus", default=None, help="corpus folder (default: the bundled sample)")
    parser.add_argument(
        "--calib-docs", type=int, default=8, help="validation documents per domain (selection)"
    )
    parser.add_argument("--eval-docs", type=int, default=16, help="held-out test documents per domain")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--fractions", default="1,0.5,0.25,0.125")
    parser.add_argument(
        "--methods", default="router",
        help=f"comma-separated selection methods for the retention table ({', '.join(METHODS)}); the router "
        "selection is always measured (EMO's default; the figure draws it)",
    )  # fmt: skip
    parser.add_argument("--iters", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="bootstrap seed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--quantize", default=None, metavar="|".join(reversed(SCHEMES)),
        help="quantize both models' experts after choosing the subsets (moectl.loaded.quantize_loaded; routers "
        "stay float32): every loss is the quantized model's, relative to the quantized full model, and the "
        "JSON adds the quantized full model's loss relative to the unquantized one",
    )  # fmt: skip
    parser.add_argument(
        "--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="int4 group (inputs per scale and zero)"
    )
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/reference/subset_retention.json")
    )
    parser.add_argument("--plot", type=Path, default=None, help="write EMO Figure 3's plot to this PNG")
    parser.add_argument(
        "--replot", type=Path, default=None, help="only redraw --plot from this earlier --json"
    )
    ft = parser.add_argument_group("fine-tuning (EMO appendix C, small budget)")
    ft.add_argument("--finetune", action="store_true", help="also fine-tune subsets before measuring")
    ft.add_argument("--ft-fractions", default=None, help="kept fractions to fine-tune (default: all below 1)")
    ft.add_argument("--ft-domains", default=None, help="comma-separated domains to fine-tune (default: all)")
    ft.add_argument("--ft-docs", type=int, default=64, help="training documents per domain")
    ft.add_argument("--ft-steps", type=int, default=20, help="at most this many optimiser steps")
    ft.add_argument("--ft-epochs", type=int, default=1)
    ft.add_argument("--ft-lr", type=float, default=5e-5, help="EMO: 5e-5")
    ft.add_argument("--ft-batch", type=int, default=32, help="effective batch (EMO: 32)")
    ft.add_argument("--ft-micro", type=int, default=8, help="micro-batch (gradient accumulation)")
    ft.add_argument(
        "--ft-max-length", type=int, default=None, help="training tokens per document (default: --max-length)"
    )
    args = parser.parse_args(argv)
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        fail(f"--plot must name a .png file, got {args.plot}")
    if args.replot is not None:
        if args.plot is None:
            fail("--replot needs --plot PNG (the figure to draw)")
        try:
            payload = json.loads(args.replot.read_text())
        except (OSError, ValueError) as err:
            fail(f"--replot {args.replot}: cannot read it as JSON ({err})")
        if not isinstance(payload, dict) or not {"models", "summary", "results"} <= set(payload):
            fail(
                f"--replot {args.replot}: not a subset_retention --json file (needs models, summary, results)"
            )
        replot(payload, args.plot)
        return
    if args.models is None:
        fail("--models STANDARD EMO is required (two checkpoints)")
    fractions = _fractions(args.fractions, "--fractions")
    try:
        args.method_list = list(dict.fromkeys(["router", *(method_name(m) for m in args.methods.split(","))]))
    except ValueError as err:
        fail(f"--methods: {err}")
    args.ft_fraction_list = (
        _fractions(args.ft_fractions, "--ft-fractions")
        if args.ft_fractions
        else [f for f in fractions if f < 1]
    )
    if not set(args.ft_fraction_list) <= set(fractions):
        fail(f"--ft-fractions {args.ft_fractions} must be among --fractions {args.fractions}")
    try:
        check_scheme(args.quantize)
        if args.quantize == "int4":
            check_group_size(args.group_size)
    except ConfigError as err:
        fail(f"--quantize / --group-size: {err}")
    torch.set_num_threads(args.threads)
    if args.corpus is None:
        from moectl.data.sample import sample_corpus_dir

        args.corpus = str(sample_corpus_dir())
    calib = corpus_texts_by_domain(args.corpus, args.calib_docs, "validation")
    heldout = corpus_texts_by_domain(args.corpus, args.eval_docs, "test")
    train = None
    if args.finetune:
        wanted = args.ft_domains.split(",") if args.ft_domains else sorted(heldout)
        if unknown := sorted(set(wanted) - set(heldout)):
            fail(f"--ft-domains {','.join(unknown)} not in the corpus; domains: {','.join(sorted(heldout))}")
        train = {
            d: t for d, t in corpus_texts_by_domain(args.corpus, args.ft_docs, "train").items() if d in wanted
        }
    seconds, results, quantized = {}, {}, {}
    for name, path in zip(NAMES, args.models, strict=True):
        start = time.perf_counter()
        results[name], quantized[name] = retention(path, calib, heldout, train, fractions, args)
        seconds[name] = round(time.perf_counter() - start, 1)
    summary = summarise(results, fractions, args)
    docs = sum(len(t) for t in heldout.values())
    against = f", against the {args.quantize} full model" if args.quantize else ""
    print(
        f"\nmean relative loss increase over {len(heldout)} domains ({docs} held-out test documents{against})"
    )
    print_summary(summary)
    print_methods(summary, {name: Path(p).name for name, p in zip(NAMES, args.models, strict=True)})
    quantization = None
    if args.quantize:
        quantization = {
            "scheme": args.quantize,
            "group_size": quantized[NAMES[0]]["group_size"],
            "scope": "experts",
            "activations": "float32",
            "reference": (
                "summary and results are relative to the quantized full model (results[model][domain]['full', "
                "'nll_full']); results[model][domain]['unquantized'] holds the unquantized full model's losses"
            ),
            "selection": (
                "subsets chosen (and fine-tuned) on the unquantized model, then applied as masks to the "
                "quantized one (a fine-tuned subset is quantized after its fine-tuning)"
            ),
            "models": quantized,
            **quantization_summary(results, fractions, args),
        }
        print(
            f"\n{quant_note(quantization)} full model vs unquantized (mean relative loss increase over domains)"
        )
        for name, path in zip(NAMES, args.models, strict=True):
            cell = quantization["full_model"][name]
            print(
                f"  {Path(path).name:<28}{cell['relative']:+7.2%} [{cell['ci95'][0]:+.2%}, {cell['ci95'][1]:+.2%}]"
            )
        print("quantized subsets vs the unquantized full model")
        for key, cells in quantization["subsets_vs_unquantized"].items():
            text = "".join(f"{c['relative']:+7.2%} [{c['ci95'][0]:+.2%}, {c['ci95'][1]:+.2%}]".ljust(28)
                           for c in cells.values())  # fmt: skip
            print(f"  {float(key):<8.1%}{text}")
    if args.finetune:
        domains = next(e["finetuned"]["domains"] for e in summary.values() if "finetuned" in e)
        print(f"\nafter fine-tuning ({', '.join(domains)}; relative to the full model without fine-tuning)")
        print_summary(summary, "finetuned")
    settings = {k: v for k, v in vars(args).items() if k.startswith("ft_") and k != "ft_fraction_list"}
    settings["ft_fractions"] = args.ft_fraction_list
    payload = {
        "models": args.models,
        "corpus": str(args.corpus),
        "settings": {"calib_docs": args.calib_docs, "eval_docs": args.eval_docs, "max_length": args.max_length,
                     "selection": "router", "methods": args.method_list,
                     "threads": args.threads, "quantize": args.quantize,
                     "group_size": quantization["group_size"] if quantization else None},
        "finetune": settings if args.finetune else None,
        "quantization": quantization,
        "intervals": {"confidence": 0.95, "method": "percentile bootstrap over held-out documents (pooled, "
                      "paired across subsets and models)", "iters": args.iters, "seed": args.seed},
        "seconds": seconds,
        "summary": summary,
        "results": results,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.json, json.dumps(payload, indent=1))
    if args.plot is not None:
        labels = {name: Path(p).name for name, p in zip(NAMES, args.models, strict=True)}
        plot(summary, labels, sorted(heldout), docs, args.plot, finetune_note(payload["finetune"]),
             quant_note(quantization))  # fmt: skip


if __name__ == "__main__":
    main()
