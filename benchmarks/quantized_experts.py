"""Quantized experts at load (issue 40 item 1): the kernels, decode speed and quality of int8 / int4 against bf16.

Three parts, each measured in this one run (ratios within a part are what to read; the machine's
load is printed and saved beside them):

1. ``kernels`` — one expert's product at OLMoE-1B-7B's expert shapes ([2048, 2048] gate/up and
   [2048, 1024] down), ``--kernel-rows`` rows (1 and 8), ``--threads`` threads, cycling over
   ``--kernel-experts`` experts so the weights come from memory, median of ``--rounds`` interleaved
   rounds: bf16 ``F.linear``, moectl's bf16 kernel (where it runs on this CPU), PyTorch's
   ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` at each group size (32, 64, 128,
   256), with each format's weight error (relative MSE and relative max of the dequantised weight;
   on random Gaussian weights and on the reference model's learned expert weights); then the rows at
   which a dequantised bf16 GEMM overtakes the int4 kernel (``int4_groups.INT4_KERNEL_MAX_ROWS``);
2. ``decode`` — engine decode tokens/s of each model of ``--decode-models`` (the reference model,
   OLMoE-1B-7B's dimensions with ``--olmoe-layers`` layers of random bf16 weights) in bf16, int8,
   int4 and int4 with every Linear quantized (``scope="all"``), 1 and 8 rows, prefill untimed,
   median of ``--rounds`` interleaved rounds; with the weight bytes a one-row step reads and the
   GB/s that makes;
3. ``quality`` — on ``--docs`` held-out test documents of ``--corpus`` (its test split), teacher
   forced through the reference model: the KL of each quantized model's next-token distribution to
   the bf16 model's per token, the perplexity ratio (each with a bootstrap 95% interval over
   documents) and how often the argmax token agrees, for int8 and int4 at each group size.

    python benchmarks/quantized_experts.py --corpus runs/corpus \\
        --json benchmarks/results/quantized_experts.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import fail
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.eval.intervals import bootstrap_interval
from moectl.io.atomic import write_text_atomic
from moectl.kernels import bf16_rows
from moectl.offload.int8 import dequantize_rows, quantize_rows
from moectl.options.prompt_data import texts_by_domain
from moectl.quant import GROUP_SIZES, quantize_model
from moectl.quant import int4_groups as int4

REFERENCE = "models/moectl-small-standard"
OLMOE_SHAPES = {"gate_up": (2048, 2048), "down": (2048, 1024)}  # [N, K] of one expert's products
VARIANTS = {  # decode rows: name -> (scheme, scope)
    "bf16": (None, None),
    "int8": ("int8", "experts"),
    "int4": ("int4", "experts"),
    "int4-all": ("int4", "all"),
}


def _median_ms(fns: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    """Median over ``rounds`` interleaved rounds of each callable's time (ms per call, ``reps`` calls)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up: kernels built, pages touched
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - start) / reps * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def _errors(w: torch.Tensor, back: torch.Tensor) -> dict[str, float]:
    w, back = w.float(), back.float()
    return {
        "rel_mse": float((back - w).pow(2).mean() / w.pow(2).mean()),
        "rel_max": float((back - w).abs().max() / w.abs().max()),
    }


def _formats(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each format's dequantised copy of a [N, K] bf16 weight."""
    out = {"int8": dequantize_rows(*quantize_rows(w), torch.float32)}
    for g in GROUP_SIZES:
        packed, scale_zero, used = int4.quantize(w, g, torch.bfloat16)
        out[f"int4-g{g}"] = int4.dequantize(packed, scale_zero, used, *w.shape, torch.float32)
    return out


def _reference_expert_errors() -> dict[str, dict[str, float]]:
    """Weight errors on the reference model's learned expert weights (every layer's expert 0..3)."""
    _, _, info = moectl.load(REFERENCE)
    acc: dict[str, list[dict[str, float]]] = {}
    for layer in info.layers:
        experts = layer.block.experts
        for e in range(4):
            for w in (experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()):
                for name, back in _formats(w).items():
                    acc.setdefault(name, []).append(_errors(w, back))
    return {name: {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} for name, rows in acc.items()}


def _time_shape(n: int, k: int, args, gen: torch.Generator) -> tuple[dict, dict]:
    """(ms per product by rows and kernel, weight errors) of [n, k] experts in every format."""
    n_exp = args.kernel_experts
    weights = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(n_exp)]
    int8 = [(q, s.to(torch.bfloat16)) for q, s in (quantize_rows(w) for w in weights)]
    int4s = {g: [int4.quantize(w, g, torch.bfloat16) for w in weights] for g in GROUP_SIZES}
    errors = {name: _errors(weights[0], back) for name, back in _formats(weights[0]).items()}

    def bf16(x: torch.Tensor) -> list:
        return [F.linear(x, w) for w in weights]

    def moectl_bf16(x: torch.Tensor) -> list:
        return [bf16_rows.linear(x, w, None) for w in weights]

    def int8_mm(x: torch.Tensor) -> list:
        return [torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s in int8]

    def int4_mm(x: torch.Tensor, g: int) -> list:
        return [torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, g, sz) for p, sz, _ in int4s[g]]

    by_rows = {}
    for rows in args.kernel_rows:
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        fns: dict[str, Callable[[], object]] = {
            "bf16 F.linear": lambda x=x: bf16(x),
            "int8 _weight_int8pack_mm": lambda x=x: int8_mm(x),
        }
        if bf16_rows.applies(x, weights[0]):
            fns["bf16 moectl kernel"] = lambda x=x: moectl_bf16(x)
        for g in GROUP_SIZES:
            fns[f"int4 g{g} _weight_int4pack_mm_for_cpu"] = lambda x=x, g=g: int4_mm(x, g)
        per_call = _median_ms(fns, args.rounds, 3)
        by_rows[str(rows)] = {name: ms / n_exp for name, ms in per_call.items()}  # ms per product
    return by_rows, errors


def kernels(args) -> dict:
    """Part 1: per-product times at OLMoE's expert shapes, weight errors, the int4 crossover."""
    gen = torch.Generator().manual_seed(0)
    result: dict = {"experts_cycled": args.kernel_experts, "shapes": {}, "errors_random": {}}
    for shape_name, (n, k) in OLMOE_SHAPES.items():
        by_rows, errors = _time_shape(n, k, args, gen)
        result["errors_random"][shape_name] = errors
        result["shapes"][shape_name] = {"n": n, "k": k, "ms_per_product": by_rows}
    result["errors_reference_experts"] = _reference_expert_errors()
    result["crossover"] = crossover(args)
    return result


def crossover(args) -> dict:
    """ms of the int4 kernel and of dequantising + a bf16 GEMM ([2048, 2048], group 128) by rows."""
    w = (torch.randn(2048, 2048, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    packed, scale_zero, g = int4.quantize(w, 128, torch.bfloat16)
    out = {}
    for rows in (16, 32, 64, 96, 128, 192, 256):
        x = torch.randn(rows, 2048).to(torch.bfloat16)

        def gemm(x=x):
            wd = int4.dequantize(packed, scale_zero, g, 2048, 2048, torch.bfloat16)
            return bf16_rows.linear(x, wd, None) if bf16_rows.applies(x, wd) else F.linear(x, wd)

        ms = _median_ms(
            {"kernel": lambda x=x: int4.kernel_linear(x, packed, scale_zero, g, 2048), "dequantised": gemm},
            args.rounds,
            2,
        )
        out[str(rows)] = ms
    return {"group": g, "ms": out, "kernel_max_rows_in_use": int4.INT4_KERNEL_MAX_ROWS}


# -- decode ---------------------------------------------------------------------------------------
def _load(spec: str, variant: str, group: int):
    scheme, scope = VARIANTS[variant]
    model, tok, _ = moectl.load(spec, dtype="bfloat16")
    summary = None if scheme is None else quantize_model(model, scheme, group_size=group, scope=scope)
    return model, tok, summary


def _step_bytes(model) -> int:
    """Weight bytes one decode step of one row reads: every parameter and buffer but the input
    embedding (one row of it; a tied one is read whole as the LM head) and, per MoE layer, top-k of
    its experts (each tensor once)."""
    info = moectl.inspect(model)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = getattr(head, "weight", None) is embed
    experts = set()
    expert_bytes = 0
    for layer in info.layers:
        module = layer.block.experts
        tensors = list(module.parameters()) + list(module.buffers())
        experts |= {id(t) for t in tensors}
        expert_bytes += sum(t.numel() * t.element_size() for t in tensors) * layer.top_k // layer.num_experts
    seen, rest = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or id(t) in experts or (t is embed and not tied):
            continue
        seen.add(id(t))
        rest += t.numel() * t.element_size()
    return rest + expert_bytes


def _decode_once(model, tok, rows: int, tokens: int) -> float:
    """Decode tokens/s of ``rows`` rows through the engine, prefill untimed."""
    prompts = [f"Prompt number {i}: the history of the city of" for i in range(rows)]
    engine = Engine(model, tok, EngineConfig(max_batch=rows))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    with engine:
        for p in prompts:
            engine.submit(p, params)
        while engine.stats()["waiting"]:
            engine.step()
        made = engine.counters["generated_tokens"]
        start = time.perf_counter()
        while engine.stats()["running"]:
            engine.step()
        wall = time.perf_counter() - start
        return (engine.counters["generated_tokens"] - made) / wall


def decode(spec: str, args) -> dict:
    """Part 2 for one model: tokens/s of every variant, rows 1 and 8, median of interleaved rounds."""
    models = {v: _load(spec, v, args.group_size) for v in args.variants}
    for model, tok, _ in models.values():
        _decode_once(model, tok, 1, 4)  # warm-up: kernels, first-call paths
    speeds: dict[str, dict[int, list[float]]] = {v: {r: [] for r in args.decode_rows} for v in models}
    for _ in range(args.rounds):
        for rows in args.decode_rows:
            for v, (model, tok, _) in models.items():
                speeds[v][rows].append(_decode_once(model, tok, rows, args.decode_tokens))
    out: dict = {"model": spec, "variants": {}}
    for v, (model, _, summary) in models.items():
        step = _step_bytes(model)
        tps = {str(r): statistics.median(s) for r, s in speeds[v].items()}
        out["variants"][v] = {
            "tokens_per_s": tps,
            "tokens_per_s_rounds": {str(r): s for r, s in speeds[v].items()},
            "step_bytes_1_row": step,
            "read_gb_per_s_1_row": step * tps.get("1", float("nan")) / 1e9,
            "model_bytes": moectl.quant.model_bytes(model),
            "quantize": None if summary is None else summary.to_dict(),
        }
    base = out["variants"].get("bf16")
    if base is not None:
        for row in out["variants"].values():
            row["vs_bf16"] = {
                r: row["tokens_per_s"][r] / base["tokens_per_s"][r] for r in row["tokens_per_s"]
            }
    return out


# -- quality --------------------------------------------------------------------------------------
def _documents(corpus: str | None, docs: int) -> list[str]:
    groups = texts_by_domain(corpus, "test")
    columns = list(groups.values())
    spread = [col[i] for i in range(max(len(c) for c in columns)) for col in columns if i < len(col)]
    return spread[:docs]


@torch.no_grad()
def quality(args) -> dict:
    """Part 3: KL per token to the bf16 reference model, perplexity ratio, argmax agreement."""
    texts = _documents(args.corpus, args.docs)
    base, tok, _ = moectl.load(REFERENCE)
    variants = {"int8": ("int8", None), **{f"int4-g{g}": ("int4", g) for g in GROUP_SIZES}}
    models = {}
    for name, (scheme, group) in variants.items():
        model, _, _ = moectl.load(REFERENCE)
        quantize_model(model, scheme, group_size=group or 128)
        models[name] = model
    nll_base, counts = [], []
    kl_sum = {n: [] for n in models}
    nll = {n: [] for n in models}
    agree = {n: [] for n in models}
    for text in texts:
        ids = torch.tensor([tok(text, truncation=True, max_length=args.max_length)["input_ids"]])
        if ids.shape[1] < 2:
            continue
        targets = ids[0, 1:]
        ref = base(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        nll_base.append(float(F.nll_loss(ref, targets, reduction="sum")))
        counts.append(targets.numel())
        for name, model in models.items():
            got = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            kl_sum[name].append(float((ref.exp() * (ref - got)).sum()))
            nll[name].append(float(F.nll_loss(got, targets, reduction="sum")))
            agree[name].append(int((got.argmax(-1) == ref.argmax(-1)).sum()))
    c = np.array(counts, dtype=np.float64)
    nb = np.array(nll_base)
    out: dict = {
        "model": REFERENCE,
        "corpus": args.corpus or "the shipped sample corpus",
        "docs": len(counts),
        "tokens": int(c.sum()),
        "ppl_bf16": float(np.exp(nb.sum() / c.sum())),
        "variants": {},
    }
    for name in models:
        kl, nq, ag = np.array(kl_sum[name]), np.array(nll[name]), np.array(agree[name], dtype=np.float64)

        def kl_mean(w: np.ndarray, kl=kl) -> np.ndarray:
            return (w @ kl) / np.maximum(w @ c, 1.0)

        def ppl_ratio(w: np.ndarray, nq=nq) -> np.ndarray:
            return np.exp((w @ nq - w @ nb) / np.maximum(w @ c, 1.0))

        out["variants"][name] = {
            "kl_per_token": float(kl.sum() / c.sum()),
            "kl_per_token_ci95": bootstrap_interval(kl_mean, len(c)),
            "ppl": float(np.exp(nq.sum() / c.sum())),
            "ppl_ratio": float(np.exp((nq.sum() - nb.sum()) / c.sum())),
            "ppl_ratio_ci95": bootstrap_interval(ppl_ratio, len(c)),
            "argmax_agreement": float(ag.sum() / c.sum()),
        }
    return out


# -- report ---------------------------------------------------------------------------------------
def _print(result: dict) -> None:
    setup = result["setup"]
    print(f"load: {setup['load_before']} before (1/5/15 min), {setup['load_after']} after; "
          f"{setup['threads']} torch threads on {setup['cpus']} CPUs")  # fmt: skip
    k = result.get("kernels")
    if k:
        for shape, data in k["shapes"].items():
            print(
                f"\n{shape} [{data['n']}, {data['k']}]: ms per product (median), cycling {k['experts_cycled']} experts"
            )
            names = list(next(iter(data["ms_per_product"].values())))
            for name in names:
                cells = "  ".join(f"{r} rows {v[name]:7.3f}" for r, v in data["ms_per_product"].items())
                print(f"  {name:<40} {cells}")
        print("\nweight error (relative MSE, relative max): random | reference model's experts")
        for name, err in k["errors_random"]["gate_up"].items():
            ref = k["errors_reference_experts"][name]
            print(
                f"  {name:<10} {err['rel_mse']:.5f} {err['rel_max']:.4f} | {ref['rel_mse']:.5f} {ref['rel_max']:.4f}"
            )
        print(f"\nint4 kernel vs dequantise + bf16 GEMM, [2048, 2048] group {k['crossover']['group']} (ms):")
        for rows, ms in k["crossover"]["ms"].items():
            print(f"  {rows:>4} rows: kernel {ms['kernel']:7.3f}  dequantised {ms['dequantised']:7.3f}")
    for d in result.get("decode", []):
        print(f"\ndecode tokens/s, {d['model']} (median of {setup['rounds']} rounds)")
        for v, row in d["variants"].items():
            tps = "  ".join(f"{r} rows {t:7.2f}" for r, t in row["tokens_per_s"].items())
            ratio = "  ".join(f"{r}: {x:.2f}x" for r, x in row.get("vs_bf16", {}).items())
            print(f"  {v:<9} {tps}   vs bf16 {ratio}   1-row step reads {row['step_bytes_1_row'] / 2**20:8.1f} MiB "
                  f"({row['read_gb_per_s_1_row']:.1f} GB/s), model {row['model_bytes'] / 2**20:8.1f} MiB")  # fmt: skip
    q = result.get("quality")
    if q:
        print(f"\nquality, {q['model']}: {q['docs']} test documents of {q['corpus']} ({q['tokens']} tokens), "
              f"bf16 perplexity {q['ppl_bf16']:.3f}")  # fmt: skip
        for v, row in q["variants"].items():
            lo, hi = row["kl_per_token_ci95"]
            plo, phi = row["ppl_ratio_ci95"]
            print(f"  {v:<9} KL/token {row['kl_per_token']:.5f} [{lo:.5f}, {hi:.5f}]  perplexity ratio "
                  f"{row['ppl_ratio']:.4f} [{plo:.4f}, {phi:.4f}]  argmax agrees {row['argmax_agreement']:.3f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--parts", default="kernels,decode,quality", help="comma list of kernels, decode, quality"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernel-rows", default="1,8")
    ap.add_argument("--kernel-experts", type=int, default=16, help="experts cycled per timed call")
    ap.add_argument("--decode-models", nargs="*", default=[REFERENCE])
    ap.add_argument(
        "--olmoe-layers", type=int, default=4, help="also decode OLMoE-1B-7B's dims with N layers (0: no)"
    )
    ap.add_argument("--decode-rows", default="1,8")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"decode rows of: {', '.join(VARIANTS)}")
    ap.add_argument(
        "--group-size", type=int, default=moectl.quant.DEFAULT_GROUP_SIZE, help="int4 group in decode"
    )
    ap.add_argument(
        "--corpus", default=None, help="corpus folder or JSONL (test split); default: the sample corpus"
    )
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not set(parts) <= {"kernels", "decode", "quality"}:
        fail(f"--parts must name kernels, decode and/or quality, got {args.parts!r}")
    args.kernel_rows = [int(r) for r in args.kernel_rows.split(",")]
    args.decode_rows = [int(r) for r in args.decode_rows.split(",")]
    args.variants = [v.strip() for v in args.variants.split(",")]
    if not set(args.variants) <= set(VARIANTS):
        fail(f"--variants must be among {', '.join(VARIANTS)}, got {args.variants}")
    if args.group_size not in GROUP_SIZES:
        fail(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {args.group_size}")
    for name in ("threads", "rounds", "kernel_experts", "decode_tokens", "docs"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    torch.set_num_threads(args.threads)
    result: dict = {
        "setup": {
            "command": " ".join(sys.argv),
            "threads": args.threads,
            "cpus": os.cpu_count(),
            "rounds": args.rounds,
            "load_before": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__,
            "bf16_rows_kernel_wanted": bf16_rows.wanted(),
            "native_bf16": bf16_rows.native_bf16(),
        }
    }
    if "kernels" in parts:
        result["kernels"] = kernels(args)
    if "decode" in parts:
        specs = list(args.decode_models) + (
            [f"shape:olmoe-1b-7b@{args.olmoe_layers}"] if args.olmoe_layers else []
        )
        result["decode"] = []
        for spec in specs:
            result["decode"].append(decode(spec, args))
    if "quality" in parts:
        result["quality"] = quality(args)
    result["setup"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    _print(result)
    if args.json_path is not None:
        write_text_atomic(args.json_path, json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
