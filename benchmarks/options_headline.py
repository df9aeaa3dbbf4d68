"""TE-MoE Tables 2 and 3 in miniature, on moectl's own pretrained MoE.

For k-hat = N/2 and N/4: the switch rate of the plain model (router treated as an option policy,
§2.2) against trained controllers at several deliberation costs η, and quality against the
teacher (held-out per-token KL(p_teacher ‖ p_student) with 95% intervals over documents, and the
per-domain perplexity ratio student/teacher), next to the four pruning baselines (frequency,
greedy reconstruction, random per token, Wanda-structured) at the same k-hat.

Controllers are trained with ``moectl options train`` (this script trains missing ones with
``--train``); evaluation is teacher-forced on the corpus's test split, and the switch rate is
measured on tokens generated from test-document openings at temperature 0.5 (as in §5).

    python benchmarks/options_headline.py --model models/moectl-small-standard --runs runs/options \\
        --corpus data/corpus --out benchmarks/results/options_headline.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moectl.adapters.inspect import inspect
from moectl.generate import Prompt
from moectl.models.load import load_model
from moectl.options.data import read_prompts, texts_by_domain
from moectl.options.evaluate import generation_switch_rate, heldout_quality
from moectl.options.policy import ControllerPolicy
from moectl.options.state import load_controlled
from moectl.options.teacher import teacher_mode


def run_dir(runs: Path, tag: str, k_hat: int, eta: float) -> Path:
    return runs / f"{tag}-k{k_hat}-eta{eta:g}"


def controller_folder(path: Path) -> Path | None:
    """The finished run's ``final/`` (an unfinished run is skipped, not evaluated half-trained)."""
    return path / "final" if (path / "final" / "controller.json").exists() else None


def evaluate(name, model, info, tokenizer, policies, teacher, k_hat, heldout, prompts, args) -> dict:
    t0 = time.perf_counter()
    quality = heldout_quality(model, info, tokenizer, heldout, policies, teacher, args.max_length)
    switching = generation_switch_rate(
        model, info, tokenizer, prompts, policies, k_hat, args.max_new_tokens, 0.5, seed=args.seed
    )
    row = {
        "method": name,
        "k_hat": k_hat,
        "kl": quality["kl"],
        "kl_ci95": quality["kl_ci95"],
        "ppl_ratio": quality["ppl_ratio"],
        "per_domain": {
            d: {"ppl": v["ppl"], "teacher_ppl": v["teacher_ppl"], "kl": v["kl"]}
            for d, v in quality["domains"].items()
        },
        "switch_rate": switching["switch_rate"],
        "switch_rate_ci95": switching["switch_rate_ci95"],
        "switch_source": switching["source"],
        "seconds": time.perf_counter() - t0,
    }
    print(
        f"  k̂={k_hat:<3} {name:<16} KL {row['kl']:.4f} ± {row['kl_ci95']:.4f}  ppl×{row['ppl_ratio']:.3f}  "
        f"switch {row['switch_rate']:.3f} ± {row['switch_rate_ci95']:.3f}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--tag", default="std", help="run folder prefix: RUNS/TAG-kK-etaE")
    ap.add_argument("--runs", type=Path, default=Path("runs/options"))
    ap.add_argument("--corpus", default=None, help="corpus folder (default: the shipped sample corpus)")
    ap.add_argument("--k-hat", type=int, nargs="+", default=None, help="default: N/2 and N/4")
    ap.add_argument("--eta", type=float, nargs="+", default=[0.02, 0.03, 0.04])
    ap.add_argument("--baselines", nargs="*", default=["frequency", "reconstruction", "random", "wanda"])
    ap.add_argument(
        "--calib-docs", type=int, default=32, help="calibration texts for the baselines (§5: 128)"
    )
    ap.add_argument("--calib-length", type=int, default=512, help="tokens per calibration text")
    ap.add_argument("--max-docs", type=int, default=8, help="held-out documents per domain")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=18, help="prompts for the switch rate")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--train", action="store_true", help="train missing controllers (options train defaults below)"
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/options_headline.json"))
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    model, tokenizer = load_model(args.model, dtype="float32")
    info = inspect(model)
    n = info.num_experts
    k_hats = args.k_hat or [n // 2, n // 4]
    heldout = texts_by_domain(args.corpus, "test", args.max_docs)
    prompts = [Prompt(p) for p in read_prompts(args.corpus, "test", chars=200)[: args.prompts]]
    calib = read_prompts(args.corpus, "validation", chars=2000)[: args.calib_docs]
    rows = []
    from moectl.options.baselines import baseline_policy

    for k_hat in k_hats:
        plain = evaluate(
            "base model",
            model,
            info,
            tokenizer,
            list,
            lambda: teacher_mode(model, info, None),
            k_hat,
            heldout,
            prompts,
            args,
        )
        rows.append(plain)
        for method in args.baselines:
            policy = baseline_policy(
                model,
                tokenizer,
                method,
                k_hat,
                calib,
                seed=args.seed,
                info=info,
                max_length=args.calib_length,
            )
            rows.append(
                evaluate(
                    method,
                    model,
                    info,
                    tokenizer,
                    lambda p=policy: [p],
                    lambda: teacher_mode(model, info, None),
                    k_hat,
                    heldout,
                    prompts,
                    args,
                )
            )
        for eta in args.eta:
            folder = controller_folder(run_dir(args.runs, args.tag, k_hat, eta))
            if folder is None and args.train:
                from moectl.options.trainer import OptionsConfig, train_options

                lm, tok = load_model(args.model, dtype="float32")
                cfg = OptionsConfig(
                    k_hat=k_hat,
                    eta=eta,
                    steps=args.steps,
                    batch_size=8,
                    max_new_tokens=48,
                    max_prompt_tokens=64,
                    lora_experts=False,
                )
                train_options(
                    lm, tok, read_prompts(args.corpus), cfg, run_dir(args.runs, args.tag, k_hat, eta)
                )
                folder = controller_folder(run_dir(args.runs, args.tag, k_hat, eta))
            if folder is None:
                print(
                    f"  k̂={k_hat} η={eta}: no controller in {run_dir(args.runs, args.tag, k_hat, eta)} (use --train)"
                )
                continue
            lm, _ = load_model(args.model, dtype="float32")
            lm, ctrl, config, snapshot = load_controlled(lm, folder, merge=False)
            lm.eval()
            li = inspect(lm)
            row = evaluate(
                f"controller η={eta:g}",
                lm,
                li,
                tokenizer,
                lambda c=ctrl: [ControllerPolicy(c, seed=args.seed)],
                lambda lm=lm, li=li, s=snapshot: teacher_mode(lm, li, s),
                k_hat,
                heldout,
                prompts,
                args,
            )
            log = (
                [json.loads(x) for x in (folder.parent / "log.jsonl").read_text().splitlines()]
                if (folder.parent / "log.jsonl").exists()
                else []
            )
            if not log and (folder.parent.parent / "log.jsonl").exists():
                log = [json.loads(x) for x in (folder.parent.parent / "log.jsonl").read_text().splitlines()]
            row["checkpoint"] = str(folder)
            row["train_steps"] = len(log)
            row["train_config"] = config
            rows.append(row)
    print("\n| k̂ | method | KL(teacher‖student) ±95% | ppl ratio | switch rate ±95% |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['k_hat']} | {r['method']} | {r['kl']:.4f} ± {r['kl_ci95']:.4f} | {r['ppl_ratio']:.3f} | "
            f"{r['switch_rate']:.3f} ± {r['switch_rate_ci95']:.3f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.write_text(
        json.dumps({"setup": setup, "num_experts": n, "top_k": info.top_k, "rows": rows}, indent=2) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
