"""TE-MoE Tables 2 and 3 in miniature, on moectl's own pretrained MoE.

For each k-hat (default N/2 and N/4): the switch rate of the plain model (router treated as an
option policy, §2.2) against trained controllers at each deliberation cost η, and quality: the
held-out per-token KL(p_teacher ‖ p_student) with 95% intervals over documents, the per-domain
perplexity ratio student/teacher, and accuracy on every evaluation set where the full model is
above chance (``options_accuracy.py``; the tables' accuracy columns), next to the four pruning
baselines (frequency, greedy reconstruction, random per token, Wanda-structured) at the same k-hat.

Controllers are ``moectl options train`` runs named RUNS/TAG-kK-etaE (``std-k8-eta0.02`` for
``--tag std``); a run's ``final/`` is evaluated, an unfinished run is skipped unless ``--latest``
(its newest checkpoint, the step recorded in the row); ``--controller k16-eta0.02=PATH`` names a
folder for one (k-hat, η), e.g. a checkpoint kept aside (§5 evaluates k-hat = 16 at step 120);
``--train`` trains missing ones. Evaluation is teacher-forced on the corpus's test split; the
switch rate is measured on tokens generated from test-document openings at temperature 0.5 (§5).
Accuracy: the full model is screened on ``--screen-limit`` items per set, and every row is scored
on the first ``--limit`` items of the sets that pass (Wilson 95% intervals); ``--tasks`` with no
name skips accuracy. Deviation: §5 evaluates generated answers on MATH/MMLU/MMMLU; a 16M-token
model is at chance there, so the sets are zero-shot log-likelihood ones it can do.

    MOECTL_EVALS=data/evals python benchmarks/options_headline.py --model runs/ref-standard/final \\
        --runs runs/options --tag std --corpus data/corpus --k-hat 8 16 --eta 0.02 \\
        --out benchmarks/results/reference/options_headline.json

``--quantize int4|int8`` (issue 40) measures the table on a quantized model: the evaluated base
model's experts are quantized (``moectl.loaded.quantize_loaded``, int4 in groups of ``--group-size``;
routers, attention and embeddings stay float32, as do the activations). Each controller is loaded
into a fresh float32 model, its LoRA adapters and routers merged into the unquantized weights, and
only then quantized (``quantize_loaded``'s ``merge_first``): its held-out quality and accuracy are
of that merged, quantized model. The teacher of every row is the quantized base model, so KLs and
perplexity ratios compare with the quantized full model. The pruning baselines are selected on the
unquantized model (the same calibration as without ``--quantize``; wanda reads float weights) and
applied as expert masks to the quantized one. The JSON's ``quantization`` holds the scheme, what was
quantized and the quantized base model's KL and perplexity ratio to the unquantized one (what
quantizing itself costs).

    MOECTL_EVALS=data/evals python benchmarks/options_headline.py --model models/moectl-small-standard \\
        --runs runs/options --tag std --corpus data/corpus --k-hat 8 --eta 0.32 --quantize int4 \\
        --out benchmarks/results/reference/options_headline_int4.json

The JSON (``--out``, rewritten after every row) holds the setup, the screening and the rows, with
the wall and CPU seconds of each part. Cost measured on moectl-small (N = 32, 2 k-hats × (4
baselines + one η), --screen-limit 200, --limit 100): 922 s of one thread's CPU; a row's quality
~17 s (controller ~25 s), its accuracy on 3 sets ~21 s (controller ~95 s: the option scan per
position); so the defaults with 3 η come to about 30 min of one thread.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moectl.adapters.inspect import inspect
from moectl.eval.policy_file import EvalRouting, setup_routing
from moectl.generate import Prompt
from moectl.loaded import quantize_loaded
from moectl.models.load import load_model
from moectl.options.evaluate import generation_switch_rate, heldout_quality
from moectl.options.option_state import latest_checkpoint, load_controlled
from moectl.options.policy import ControllerPolicy
from moectl.options.prompt_data import read_prompts, texts_by_domain
from moectl.options.random_options import check_k_hat
from moectl.options.teacher import teacher_mode
from moectl.quant.quant_config import DEFAULT_GROUP_SIZE, SCHEMES, check_group_size, check_scheme
from options_accuracy import TASKS, EvalSet, chance, load_sets, score_set, screen


class PairedTeacher(nn.Module):
    """``student``'s forward, but ``teacher``'s inside :meth:`teaching`.

    ``heldout_quality``'s teacher is a context around the one model it is given. A controller merged
    into quantized weights (``--quantize``) cannot take its adapters off again, so its teacher, the
    quantized base model, is another model: this calls the one or the other (routing sessions hook
    this module and the student's routers; the teacher runs outside them)."""

    def __init__(self, student: nn.Module, teacher: nn.Module) -> None:
        super().__init__()
        self.student, self.teacher = student, teacher
        self._teaching = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self.teacher if self._teaching else self.student)(*args, **kwargs)

    @contextmanager
    def teaching(self):
        self._teaching = True
        try:
            with torch.no_grad():
                yield
        finally:
            self._teaching = False


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def spent(t0: tuple[float, float]) -> dict[str, float]:
    """Wall and CPU seconds since ``t0`` (CPU time: what one idle thread would take, on a busy machine)."""
    wall, cpu = now()
    return {"wall_s": round(wall - t0[0], 1), "cpu_s": round(cpu - t0[1], 1)}


def run_dir(runs: Path, tag: str, k_hat: int, eta: float) -> Path:
    return runs / f"{tag}-k{k_hat}-eta{eta:g}"


def controller_folder(path: Path, latest: bool = False) -> Path | None:
    """The finished run's ``final/``; else with ``latest`` its newest complete checkpoint; else None
    (an unfinished run is not evaluated half-trained unless asked)."""
    if (path / "final" / "controller.json").exists():
        return path / "final"
    return latest_checkpoint(path) if latest else None


def copy_aside(folder: Path, dest: Path) -> Path:
    """Copy a running run's checkpoint aside (without the optimizer state): the trainer keeps only
    the newest two, so the folder may vanish while it is being evaluated."""
    import shutil

    copy = dest / f"{folder.parent.parent.name}-{folder.name}"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("trainer_state.pt"))
    return copy


def folder_step(folder: Path) -> int | None:
    """The training step a controller folder holds: its ``trainer_state.pt``'s step (a checkpoint,
    or a copy of one set aside under any name), else ``step-N`` in its name, else the last step of
    its ``training_log.jsonl`` (a ``moectl options card`` folder), else ``final/``'s configured steps."""
    state = folder / "trainer_state.pt"
    if state.exists():
        step = torch.load(state, map_location="cpu", weights_only=True).get("step")
        if step is not None:
            return int(step)
    match = re.search(r"step-0*(\d+)$", folder.name)  # also a copy named RUN-step-N
    if match:
        return int(match.group(1))
    log = folder / "training_log.jsonl"  # a `moectl options card` folder: its log ends at its step
    if log.exists():
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        if rows:
            return int(rows[-1]["step"])
    options = folder / "options.json"
    return json.loads(options.read_text()).get("steps") if options.exists() else None


def paired_kl(rows: list[dict]) -> list[dict]:
    """Each controller's KL minus each baseline's, and minus each controller listed before it (η =
    0.04 against η = 0.02), at the same k-hat, on the same held-out documents: the mean difference
    and its paired bootstrap 95% interval (documents resampled together)."""
    import numpy as np

    from moectl.eval.intervals import bootstrap_interval

    out = []
    for i, row in enumerate(rows):
        if not row["method"].startswith("controller"):
            continue
        for j, other in enumerate(rows):
            earlier_controller = other["method"].startswith("controller") and j < i
            if other["k_hat"] != row["k_hat"] or other["method"].startswith("base"):
                continue
            if other["method"].startswith("controller") and not earlier_controller:
                continue
            diff = np.asarray(row["kl_docs"]) - np.asarray(other["kl_docs"])
            lo, hi = bootstrap_interval(lambda c, d=diff: (c @ d) / len(d), len(diff))
            out.append({"k_hat": row["k_hat"], "method": row["method"], "against": other["method"],
                        "difference": float(diff.mean()), "ci95": [lo, hi], "documents": len(diff)})  # fmt: skip
    return out


def parse_overrides(specs: list[str]) -> dict[tuple[int, float], Path]:
    """``kK-etaE=PATH`` → {(K, E): PATH}; ``ValueError`` naming the bad one."""
    out = {}
    for spec in specs:
        match = re.fullmatch(r"k(\d+)-eta([0-9.eE+-]+)=(.+)", spec)
        if not match:
            raise ValueError(f"--controller {spec!r}: expected kK-etaE=PATH, e.g. k16-eta0.02=runs/ckpt")
        path = Path(match.group(3))
        if not (path / "controller.json").exists():
            raise ValueError(f"--controller {spec!r}: {path} holds no controller.json")
        out[(int(match.group(1)), float(match.group(2)))] = path
    return out


def accuracy(model, tokenizer, routing: EvalRouting, sets: dict[str, EvalSet], args) -> dict[str, Any]:
    max_length = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    return {
        task: score_set(
            model,
            tokenizer,
            routing,
            evalset,
            args.limit,
            args.cache,
            args.eval_batch_size,
            max_length,
            args.seed,
        )
        for task, evalset in sets.items()
    }


def quality_row(
    name, model, info, tokenizer, policies, teacher, k_hat, heldout, prompts, args, generating=None
) -> dict:
    """KL, per-domain perplexity ratio and generation switch rate of one method at ``k_hat``
    (``generating``: the model that generates for the switch rate, default ``model``)."""
    t0 = now()
    quality = heldout_quality(model, info, tokenizer, heldout, policies, teacher, args.max_length)
    switching = generation_switch_rate(
        generating if generating is not None else model, info, tokenizer, prompts, policies, k_hat,
        args.max_new_tokens, 0.5, seed=args.seed,
    )  # fmt: skip
    return {
        "method": name,
        "k_hat": k_hat,
        "kl": quality["kl"],
        "kl_ci95": quality["kl_ci95"],
        "kl_docs": quality["kl_docs"],
        "ppl_ratio": quality["ppl_ratio"],
        "per_domain": {
            d: {
                "ppl": v["ppl"],
                "teacher_ppl": v["teacher_ppl"],
                "ppl_ratio": v["ppl"] / v["teacher_ppl"],
                "kl": v["kl"],
                "kl_ci95": v["kl_ci95"],
            }
            for d, v in quality["domains"].items()
        },
        "switch_rate": switching["switch_rate"],
        "switch_rate_ci95": switching["switch_rate_ci95"],
        "switch_source": switching["source"],
        "time_quality": spent(t0),
    }


def show(row: dict) -> None:
    acc = "  ".join(f"{t} {100 * a['value']:.1f}" for t, a in row.get("accuracy", {}).items())
    print(
        f"  k̂={row['k_hat']:<3} {row['method']:<22} KL {row['kl']:.4f} ± {row['kl_ci95']:.4f}  "
        f"ppl×{row['ppl_ratio']:.3f}  switch {row['switch_rate']:.3f} ± {row['switch_rate_ci95']:.3f}  {acc}",
        flush=True,
    )


def table(rows: list[dict], tasks: list[str]) -> str:
    head = "| k̂ | method | KL(teacher‖student) ±95% | ppl ratio | switch % ±95% | " + " | ".join(
        f"{t} % [95%]" for t in tasks
    )
    lines = [head + " |", "|" + "---|" * (5 + len(tasks))]
    for r in rows:
        cells = [
            str(r["k_hat"]),
            r["method"],
            f"{r['kl']:.4f} ± {r['kl_ci95']:.4f}",
            f"{r['ppl_ratio']:.3f}",
            f"{100 * r['switch_rate']:.1f} ± {100 * r['switch_rate_ci95']:.1f}",
        ]
        for t in tasks:
            a = r.get("accuracy", {}).get(t)
            cells.append(
                "–"
                if a is None
                else f"{100 * a['value']:.1f} [{100 * a['ci95'][0]:.0f}, {100 * a['ci95'][1]:.0f}]"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--tag", default="std", help="run folder prefix: RUNS/TAG-kK-etaE")
    ap.add_argument("--runs", type=Path, default=Path("runs/options"))
    ap.add_argument(
        "--controller",
        action="append",
        default=[],
        metavar="kK-etaE=PATH",
        help="controller folder for one (k-hat, η), instead of the run's final/ (repeatable)",
    )
    ap.add_argument("--latest", action="store_true", help="unfinished runs: evaluate the newest checkpoint")
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
    ap.add_argument("--tasks", nargs="*", default=list(TASKS), help="evaluation sets screened for accuracy")
    ap.add_argument(
        "--screen-limit", type=int, default=500, help="items per set for the full model's screening"
    )
    ap.add_argument("--limit", type=int, default=100, help="items per set for every row (≤ --screen-limit)")
    ap.add_argument("--all-sets", action="store_true", help="score every set, above chance or not")
    ap.add_argument("--eval-batch-size", type=int, default=16)
    ap.add_argument("--cache", default=None, help="evaluation sets (default $MOECTL_EVALS)")
    ap.add_argument(
        "--train", action="store_true", help="train missing controllers (options train defaults below)"
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quantize", default=None, metavar="|".join(reversed(SCHEMES)),
        help="quantize the evaluated model's experts (controllers merged in first; baselines selected on the "
        "unquantized model); the teacher is the quantized base model",
    )  # fmt: skip
    ap.add_argument(
        "--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="int4 group (inputs per scale and zero)"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/reference/options_headline.json"))
    args = ap.parse_args(argv)
    for name in ("screen_limit", "limit", "eval_batch_size", "max_docs", "prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit > args.screen_limit:
        raise ValueError(f"--limit ({args.limit}) must be <= --screen-limit ({args.screen_limit})")
    check_scheme(args.quantize)  # ConfigError: a ValueError
    if args.quantize == "int4":
        check_group_size(args.group_size)
    return args


def quantization_cost(model, reference, info, tokenizer, heldout, args) -> dict:
    """The quantized base model's held-out KL(unquantized ‖ quantized) and perplexity ratio to the
    unquantized ``reference``: what quantizing itself costs, beside the table."""
    pair = PairedTeacher(model, reference)
    t0 = now()
    quality = heldout_quality(pair, info, tokenizer, heldout, list, pair.teaching, args.max_length)
    return {
        "kl": quality["kl"],
        "kl_ci95": quality["kl_ci95"],
        "ppl_ratio": quality["ppl_ratio"],
        "per_domain": {
            d: {
                "ppl": v["ppl"],
                "unquantized_ppl": v["teacher_ppl"],
                "ppl_ratio": v["ppl"] / v["teacher_ppl"],
            }
            for d, v in quality["domains"].items()
        },
        "time": spent(t0),
    }


def quantized_controller_row(base, tokenizer, folder: Path, eta, k_hat, heldout, prompts, chosen, args):
    """``(row, accuracy, accuracy start)`` of a controller on the quantized model: a fresh float32
    model with the controller's adapters and routers merged in, then quantized; its teacher is the
    quantized ``base`` model."""
    from moectl.routing import load_policy

    lm, _ = load_model(args.model, dtype="float32")
    quantize_loaded(lm, args.quantize, group_size=args.group_size, merge_first=[str(folder)])
    policy = load_policy(str(folder), lm)  # merged in already: only the controller is read
    if not isinstance(policy, ControllerPolicy):
        raise ValueError(f"{folder}: not a controller (got {type(policy).__name__})")
    li = inspect(lm)
    pair = PairedTeacher(lm, base)
    row = quality_row(
        f"controller η={eta:g}",
        pair,
        li,
        tokenizer,
        lambda c=policy.controller: [ControllerPolicy(c, seed=args.seed)],
        pair.teaching,
        k_hat,
        heldout,
        prompts,
        args,
        generating=lm,
    )
    row["train_config"] = policy.options
    t0 = now()
    acc = accuracy(lm, tokenizer, setup_routing(lm, controller=str(folder), seed=args.seed), chosen, args)
    return row, acc, t0


def main(argv: list[str] | None = None) -> int:
    t_start = now()
    try:
        args = parse_args(argv)
        overrides = parse_overrides(args.controller)
        model, tokenizer = load_model(args.model, dtype="float32")
        reference, reference_info, quantized = None, None, None
        if args.quantize:  # the unquantized model: baseline selection and the cost of quantizing
            reference = model
            model, _ = load_model(args.model, dtype="float32")
            quantized = quantize_loaded(model, args.quantize, group_size=args.group_size)
            reference_info = inspect(reference)
        info = inspect(model)
        k_hats = args.k_hat or [info.num_experts // 2, info.num_experts // 4]
        for k_hat in k_hats:
            check_k_hat(info, k_hat)
        sets = load_sets(args.tasks, args.cache, args.screen_limit, args.seed) if args.tasks else {}
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    heldout = texts_by_domain(args.corpus, "test", args.max_docs)
    prompts = [Prompt(p) for p in read_prompts(args.corpus, "test", chars=200)[: args.prompts]]
    calib = read_prompts(args.corpus, "validation", chars=2000)[: args.calib_docs]
    setup = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    doc: dict[str, Any] = {
        "setup": setup,
        "num_experts": info.num_experts,
        "top_k": info.top_k,
        "screening": {},
        "rows": [],
    }
    if reference is not None:
        doc["quantization"] = {
            "scheme": args.quantize,
            "group_size": quantized.group_size,
            "summary": quantized.to_dict(),
            "activations": "float32",
            "teacher": "the quantized base model (every row's KL and perplexity ratio)",
            "baselines": "selected on the unquantized model, applied as expert masks to the quantized one",
            "controllers": "adapters and routers merged into the unquantized weights, then quantized",
            "base_vs_unquantized": quantization_cost(model, reference, info, tokenizer, heldout, args),
        }
        cost = doc["quantization"]["base_vs_unquantized"]
        print(
            f"  {args.quantize} base model vs unquantized: KL {cost['kl']:.4f} ± {cost['kl_ci95']:.4f}  "
            f"ppl×{cost['ppl_ratio']:.3f}",
            flush=True,
        )

    # accuracy screening: the full model on --screen-limit items of every set
    full = setup_routing(model, seed=args.seed)
    t0 = now()
    max_length = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    for task, evalset in sets.items():
        entry = score_set(
            model,
            tokenizer,
            full,
            evalset,
            args.screen_limit,
            args.cache,
            args.eval_batch_size,
            max_length,
            args.seed,
        )
        doc["screening"][task] = screen(entry, chance(evalset, int(model.config.vocab_size)))
        s = doc["screening"][task]
        print(
            f"  screen {task:<15} {s['metric']:<8} {100 * s['value']:.1f} [{100 * s['ci95'][0]:.1f}, "
            f"{100 * s['ci95'][1]:.1f}] chance {100 * s['chance']:.1f}  "
            f"{'above chance' if s['above_chance'] else 'not above chance'}",
            flush=True,
        )
    doc["time_screening"] = spent(t0)
    chosen = {t: s for t, s in sets.items() if args.all_sets or doc["screening"][t]["above_chance"]}
    doc["accuracy_sets"] = list(chosen)
    t0 = now()
    base_acc = (
        accuracy(model, tokenizer, full, chosen, args)
        if args.limit < args.screen_limit
        else {
            t: {k: v for k, v in doc["screening"][t].items() if k in ("metric", "value", "ci95", "n")}
            for t in chosen
        }
    )
    doc["time_base_accuracy"] = spent(t0)

    from moectl.options.baselines import baseline_policy

    def add(row: dict, acc: dict, t0: tuple[float, float] | None) -> None:
        row["accuracy"], row["time_accuracy"] = acc, None if t0 is None else spent(t0)
        doc["rows"].append(row)
        show(row)
        write(args.out, doc)

    scratch = tempfile.TemporaryDirectory(prefix="options-headline-")  # --latest checkpoints copied aside
    for k_hat in k_hats:
        plain = quality_row(
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
        add(plain, base_acc, None)
        for method in args.baselines:
            policy = baseline_policy(  # with --quantize selected unquantized: masks apply to either
                model if reference is None else reference,
                tokenizer,
                method,
                k_hat,
                calib,
                seed=args.seed,
                info=info if reference is None else reference_info,
                max_length=args.calib_length,
            )
            row = quality_row(
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
            t0 = now()
            acc = accuracy(model, tokenizer, setup_routing(model, [policy], seed=args.seed), chosen, args)
            add(row, acc, t0)
        for eta in args.eta:
            run = run_dir(args.runs, args.tag, k_hat, eta)
            folder = overrides.get((k_hat, eta)) or controller_folder(run, args.latest)
            source = folder
            if folder is not None and folder.name.startswith("step-") and (k_hat, eta) not in overrides:
                folder = copy_aside(folder, Path(scratch.name))
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
                train_options(lm, tok, read_prompts(args.corpus), cfg, run)
                folder = controller_folder(run)
            if folder is None:
                print(
                    f"  k̂={k_hat} η={eta:g}: no finished controller in {run} (--latest, --controller or --train)"
                )
                continue
            if args.quantize:
                row, acc, t0 = quantized_controller_row(
                    model, tokenizer, folder, eta, k_hat, heldout, prompts, chosen, args
                )
                row.update(
                    checkpoint=str(source or folder),
                    train_step=folder_step(source or folder),
                    train_config=row.pop("train_config"),
                )
                add(row, acc, t0)
                continue
            lm, _ = load_model(args.model, dtype="float32")
            lm, ctrl, config, snapshot = load_controlled(lm, folder, merge=False)
            lm.eval()
            li = inspect(lm)
            row = quality_row(
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
            row.update(
                checkpoint=str(source or folder),
                train_step=folder_step(source or folder),
                train_config=config,
            )
            del lm
            t0 = now()
            merged, _ = load_model(args.model, dtype="float32")  # as `moectl eval --controller`: merged in
            acc = accuracy(
                merged, tokenizer, setup_routing(merged, controller=str(folder), seed=args.seed), chosen, args
            )
            add(row, acc, t0)
    scratch.cleanup()
    doc["paired"] = paired_kl(doc["rows"])
    for p in doc["paired"]:
        print(f"  k̂={p['k_hat']} {p['method']} − {p['against']}: KL {p['difference']:+.4f} "
              f"[{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}] over {p['documents']} documents")  # fmt: skip
    doc["time"] = spent(t_start)
    write(args.out, doc)
    print()
    print(table(doc["rows"], list(chosen)))
    print(f"wrote {args.out} ({doc['time']['wall_s']:.0f} s wall, {doc['time']['cpu_s']:.0f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
