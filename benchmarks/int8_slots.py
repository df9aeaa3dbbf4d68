"""int8 resident slots (``serve-offload --slot-dtype int8``): what they cost in quality, what they buy in speed.

Issue 18.3 asks for the kernel that reads fastest; ``decode_kernels.py`` measured PyTorch's int8
weight-only kernel at 2.28x bf16's bf16-equivalent GB/s. int8 is not exact, so before it is a
choice its error is measured here, on a trained model (default: moectl's reference model):

1. quality — every expert resident (budget 1.0, so only the slot dtype differs), teacher-forced
   on ``--docs`` test documents of the corpus: perplexity with bf16 slots and with int8 slots, the
   ratio with a paired bootstrap 95% interval over documents, and the largest |Δ logit| relative
   to the logits' spread; greedy continuations of ``--prompts`` prompts (``--max-new-tokens``):
   how many are identical and the mean length of the common prefix;
2. speed — decode tokens/s of each slot dtype at budget 1.0 on each ``--speed-models`` model
   (a shape preset runs at full width: ``shape:olmoe-1b-7b@2``), median of ``--rounds``
   interleaved rounds, after a warm-up that makes every expert resident; beside it the GB/s of
   weights read per decode step (non-expert weights + top-k experts per MoE layer in their slots).

    python benchmarks/int8_slots.py [--model models/moectl-small-standard] [--corpus DIR]
        [--docs 64] [--max-length 256] [--prompts 8] [--max-new-tokens 32]
        [--speed-models models/moectl-small-standard shape:olmoe-1b-7b@2] [--rounds 3] [--threads 2]
        [--json benchmarks/results/int8_slots.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench_args import fail
from moectl.adapters.inspect import inspect
from moectl.eval.intervals import bootstrap_interval
from moectl.generate import Prompt, generate_tokens, load_prompts
from moectl.models.load import load_model
from moectl.offload import OffloadConfig, offload
from moectl.options.prompt_data import read_prompts, texts_by_domain

SLOTS = ("same", "int8")


def _load(spec: str):
    """The model as offloading runs it (the experts' eager implementation: the runtime replaces it)."""
    model, tok = load_model(spec)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model, tok


def _config(slot_dtype: str) -> OffloadConfig:
    return OffloadConfig(budget=1.0, store="host", slot_dtype=slot_dtype)


def _documents(corpus: str | None, docs: int) -> list[str]:
    groups = texts_by_domain(corpus, "test")
    columns = list(groups.values())
    spread = [col[i] for i in range(max(len(c) for c in columns)) for col in columns if i < len(col)]
    return spread[:docs]


@torch.no_grad()
def _teacher_forced(
    model, tok, texts: list[str], max_length: int
) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor]]:
    """Summed NLL and predicted tokens per document, and each document's logits."""
    nll, counts, logits = [], [], []
    for text in texts:
        ids = torch.tensor([tok(text, truncation=True, max_length=max_length, verbose=False)["input_ids"]])
        out = model(input_ids=ids).logits[0, :-1].float()
        nll.append(float(F.cross_entropy(out, ids[0, 1:], reduction="sum")))
        counts.append(ids.shape[1] - 1)
        logits.append(out)
    return np.array(nll), np.array(counts, dtype=np.float64), logits


def quality(model, tok, texts: list[str], prompts: list[Prompt], args) -> dict:
    runs = {}
    for slot in SLOTS:
        with offload(model, _config(slot)):
            nll, counts, logits = _teacher_forced(model, tok, texts, args.max_length)
            greedy = generate_tokens(model, tok, prompts, args.max_new_tokens, batch_size=1, progress=False)
        runs[slot] = (nll, logits, greedy)
    (nll_a, logits_a, greedy_a), (nll_b, logits_b, greedy_b) = runs["same"], runs["int8"]

    def ratio(c: np.ndarray) -> np.ndarray:
        tokens = np.maximum(c @ counts, 1.0)
        return np.exp((c @ nll_b - c @ nll_a) / tokens)

    ppl_a, ppl_b = float(np.exp(nll_a.sum() / counts.sum())), float(np.exp(nll_b.sum() / counts.sum()))
    delta = max(float((a - b).abs().max()) for a, b in zip(logits_a, logits_b, strict=True))
    spread = float(torch.cat([a.std(-1) for a in logits_a]).mean())
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(greedy_a, greedy_b, strict=True)
    ]
    return {
        "docs": len(texts),
        "tokens": int(counts.sum()),
        "ppl_same": ppl_a,
        "ppl_int8": ppl_b,
        "ppl_ratio": ppl_b / ppl_a,
        "ppl_ratio_ci95": bootstrap_interval(ratio, len(texts)),
        "max_abs_logit_delta": delta,
        "logit_std_mean": spread,
        "greedy_identical": sum(list(a) == list(b) for a, b in zip(greedy_a, greedy_b, strict=True)),
        "greedy_prompts": len(prompts),
        "greedy_common_prefix_mean": float(np.mean(prefix)),
        "max_new_tokens": args.max_new_tokens,
    }


def _bytes_per_token(model, rt) -> tuple[int, int]:
    """(weights read per decode step in slots, the same in the stored dtype): the non-expert weights
    but the input embedding (one row is read; a tied one is read whole as the output layer) and
    top-k experts per MoE layer."""
    info = inspect(model)
    totals = rt.totals()
    embed = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embed
    non_expert = sum(t.numel() * t.element_size() for t in model.parameters() if tied or t is not embed)
    k = info.top_k
    return (
        non_expert + k * sum(totals["expert_bytes"]),
        non_expert + k * sum(totals["stored_expert_bytes"]),
    )


def speed(spec: str, args) -> dict:
    model, tok = _load(spec)
    prompts = load_prompts(None)[: args.speed_prompts]
    n = args.speed_tokens
    times: dict[str, list[float]] = {s: [] for s in SLOTS}
    read: dict[str, tuple[int, int]] = {}
    for _ in range(args.rounds):
        for slot in SLOTS:
            with offload(model, _config(slot)) as rt:
                for res in rt.resident_sets:  # every expert resident before timing: no loads timed
                    for expert in range(res.budget):
                        res.ensure(expert)
                    res.drain()
                generate_tokens(model, tok, prompts[:1], 2, batch_size=1, progress=False)  # warm-up
                for p in prompts:  # prefill untimed: time the decode steps only
                    t0 = time.perf_counter()
                    generate_tokens(model, tok, [p], 1, batch_size=1, progress=False)
                    t1 = time.perf_counter()
                    generate_tokens(model, tok, [p], n + 1, batch_size=1, progress=False)
                    times[slot].append((time.perf_counter() - t1 - (t1 - t0)) / n)
                read[slot] = _bytes_per_token(model, rt)
    rows = {}
    for slot in SLOTS:
        per_token = float(np.median(times[slot]))
        rows[slot] = {
            "decode_tokens_per_s": 1 / per_token,
            "weights_read_per_token_bytes": read[slot][0],
            "weights_read_gb_per_s": read[slot][0] / per_token / 1e9,
            "stored_dtype_equivalent_gb_per_s": read[slot][1] / per_token / 1e9,
        }
    rows["int8_speedup"] = rows["int8"]["decode_tokens_per_s"] / rows["same"]["decode_tokens_per_s"]
    del model
    return {"model": spec, "prompts": len(prompts), "decode_tokens": n, "rounds": args.rounds, **rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/moectl-small-standard")
    ap.add_argument("--corpus", default=None, help="corpus folder (default: the shipped sample corpus)")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument(
        "--speed-models", nargs="*", default=["models/moectl-small-standard", "shape:olmoe-1b-7b@2"]
    )
    ap.add_argument("--speed-prompts", type=int, default=3)
    ap.add_argument("--speed-tokens", type=int, default=16, help="decode steps timed per prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for name in ("docs", "prompts", "max_new_tokens", "speed_prompts", "speed_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    model, tok = _load(args.model)
    texts = _documents(args.corpus, args.docs)
    prompts = [Prompt(p) for p in read_prompts(args.corpus, "test", args.prompts, chars=200)]
    q = quality(model, tok, texts, prompts, args)
    del model
    print(f"{args.model}: {q['docs']} test documents ({q['tokens']} tokens), every expert resident")
    print(f"  perplexity bf16 slots {q['ppl_same']:.4f}, int8 slots {q['ppl_int8']:.4f}: ratio "
          f"{q['ppl_ratio']:.5f} [{q['ppl_ratio_ci95'][0]:.5f}, {q['ppl_ratio_ci95'][1]:.5f}]")  # fmt: skip
    print(f"  max |Δ logit| {q['max_abs_logit_delta']:.4f} (mean logit std {q['logit_std_mean']:.2f}); greedy "
          f"{q['greedy_identical']}/{q['greedy_prompts']} identical, common prefix "
          f"{q['greedy_common_prefix_mean']:.1f} of {q['max_new_tokens']} tokens")  # fmt: skip
    speeds = [speed(spec, args) for spec in args.speed_models]
    for s in speeds:
        print(
            f"{s['model']}: decode, every expert resident, median of {s['rounds']} rounds, {args.threads} threads"
        )
        for slot in SLOTS:
            r = s[slot]
            print(f"  {slot:>4} slots: {r['decode_tokens_per_s']:7.2f} tok/s, {r['weights_read_gb_per_s']:6.2f} GB/s read "
                  f"({r['stored_dtype_equivalent_gb_per_s']:6.2f} GB/s stored-dtype equivalent)")  # fmt: skip
        print(f"  int8 / same: {s['int8_speedup']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        setup = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(
            json.dumps({"setup": setup, "quality": q, "speed": speeds}, indent=2, default=str) + "\n"
        )


if __name__ == "__main__":
    main()
